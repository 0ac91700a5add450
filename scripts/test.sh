#!/usr/bin/env bash
# The whole test suite: set-up (first run only), build, install the Python package into .venv
# (reusing build/), then every GoogleTest case, the pytest suites and the example checks through
# ctest. Works on a fresh clone; needs no GPU.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# MESHDDP_SANITIZE=1: the C++ suites under AddressSanitizer and UBSan instead (scripts/sanitize.sh).
if [ "${MESHDDP_SANITIZE:-0}" = "1" ]; then
  exec bash "$root/scripts/sanitize.sh" "$@"
fi
bash "$root/scripts/build.sh"
bash "$root/scripts/install_python.sh"
cd "${MESHDDP_BUILD_DIR:-$root/build}"
# Two tests at a time unless told otherwise (CTEST_PARALLEL_LEVEL, or -j in the arguments): the
# multi-rank tests wait on each other's messages much of the time, so two share 2 cores well and the
# suite takes about a third of its serial time; every test's timeout allows for the sharing.
export CTEST_PARALLEL_LEVEL="${CTEST_PARALLEL_LEVEL:-2}"
ctest --output-on-failure --timeout 600 "$@"
