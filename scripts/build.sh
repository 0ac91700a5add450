#!/usr/bin/env bash
# Configures and builds meshddp (and its tests) into build/, after scripts/setup.sh. Idempotent and
# incremental. CMake args after the script name are passed through (e.g. -DMESHDDP_ENABLE_CUDA=OFF).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
build="${MESHDDP_BUILD_DIR:-$root/build}"
if [ ! -f "$build/CMakeCache.txt" ] || [ "$#" -gt 0 ]; then
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >"$build.configure.log" 2>&1 ||
    { cat "$build.configure.log"; exit 1; }
fi
cmake --build "$build" -j "$(nproc)"
