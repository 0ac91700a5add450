#!/usr/bin/env bash
# The whole test suite: set-up (first run only), build, install the Python package into .venv
# (reusing build/), then every GoogleTest case, the pytest suites and the example checks through
# ctest. Works on a fresh clone; needs no GPU.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/build.sh"
bash "$root/scripts/install_python.sh"
cd "${MESHDDP_BUILD_DIR:-$root/build}"
ctest --output-on-failure --timeout 600 "$@"
