#!/usr/bin/env bash
# The whole test suite: set-up (first run only), build, then every GoogleTest case and the example
# check through ctest. Works on a fresh clone; needs no GPU.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/build.sh"
cd "${MESHDDP_BUILD_DIR:-$root/build}"
ctest --output-on-failure --timeout 600 "$@"
