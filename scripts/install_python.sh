#!/usr/bin/env bash
# Installs the Python package `meshddp` into .venv with `pip install --no-build-isolation .`
# (pyproject.toml, scikit-build-core), reusing build/ from scripts/build.sh: the C++ engine is not
# compiled again, only the install step runs. Run after scripts/build.sh (scripts/test.sh does).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MESHDDP_VENV:-$root/.venv}"
build="${MESHDDP_BUILD_DIR:-$root/build}"
test -f "$build/CMakeCache.txt" || { echo "install_python: no $build/CMakeCache.txt; run scripts/build.sh first"; exit 1; }
# Same generator and test setting as the existing build/, so the configure step changes nothing.
generator="$(sed -n 's/^CMAKE_GENERATOR:INTERNAL=//p' "$build/CMakeCache.txt")"
tests="$(sed -n 's/^MESHDDP_BUILD_TESTS:BOOL=//p' "$build/CMakeCache.txt")"
CMAKE_GENERATOR="$generator" "$venv/bin/python" -m pip install --quiet --no-build-isolation --no-deps \
  -Cbuild-dir="$build" -Ccmake.define.MESHDDP_BUILD_TESTS="${tests:-ON}" "$root" >"$build.install_python.log" 2>&1 ||
  { cat "$build.install_python.log"; exit 1; }
"$venv/bin/python" -c "import meshddp" || { echo "install_python: 'import meshddp' failed after install"; exit 1; }
