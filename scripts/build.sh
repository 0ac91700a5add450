#!/usr/bin/env bash
# Configures and builds meshddp (and its tests) into build/, after scripts/setup.sh. Idempotent and
# incremental. CMake args after the script name are passed through (e.g. -DMESHDDP_ENABLE_CUDA=OFF).
# Shows CMake's own progress; the configure output is also kept in build/configure.log.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
build="${MESHDDP_BUILD_DIR:-$root/build}"
if [ ! -f "$build/CMakeCache.txt" ] || [ "$#" -gt 0 ]; then
  mkdir -p "$build"
  echo "[build] configuring $build (log: $build/configure.log)" >&2
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" 2>&1 | tee "$build/configure.log"
fi
echo "[build] building with $(nproc) jobs (a cold build takes ~12 min on 2 cores)" >&2
cmake --build "$build" -j "$(nproc)"
