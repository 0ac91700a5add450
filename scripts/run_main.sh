#!/usr/bin/env bash
# The main job: examples/01_ddp, data-parallel MLP training on 4 local CPU ranks launched by torchrun
# (from the project's torch wheel). Extra args go to the example (e.g. --steps 100 --seed 1).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/build.sh" >/dev/null
nproc_per_node="${NPROC_PER_NODE:-4}"
exec "$root/.venv/bin/torchrun" --standalone --nproc-per-node "$nproc_per_node" --no-python \
  "${MESHDDP_BUILD_DIR:-$root/build}/examples/ddp_example" --steps 30 "$@"
