#!/usr/bin/env bash
# The main job: examples/02_dp_x_tp_gpt, the tiny GPT trained on a 2 x 2 DP x TP mesh of 4 local CPU
# ranks launched by torchrun (from the project's torch wheel). Extra args go to the example
# (e.g. --sequence-parallel, --distributed-optimizer, --steps 100, --log-file losses.txt; all flags:
# docs/reference/examples.md). stdout: the `step <n> loss <x>` lines; stderr: set-up and build progress, then
# rank 0's step log and summary.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/build.sh" >&2
exec "$root/.venv/bin/torchrun" --standalone --nproc-per-node 4 --no-python \
  "${MESHDDP_BUILD_DIR:-$root/build}/examples/gpt_example" --dp 2 --tp 2 --steps 40 "$@"
