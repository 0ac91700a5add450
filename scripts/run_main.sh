#!/usr/bin/env bash
# The main job: examples/02_dp_x_tp_gpt, the tiny GPT trained on a 2 x 2 DP x TP mesh of 4 local CPU
# ranks launched by torchrun (from the project's torch wheel). Extra args go to the example
# (e.g. --sequence-parallel, --distributed-optimizer, --steps 100, --log-file losses.txt).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/build.sh" >/dev/null
exec "$root/.venv/bin/torchrun" --standalone --nproc-per-node 4 --no-python \
  "${MESHDDP_BUILD_DIR:-$root/build}/examples/gpt_example" --dp 2 --tp 2 --steps 40 "$@"
