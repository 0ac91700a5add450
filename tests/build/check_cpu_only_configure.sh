#!/usr/bin/env bash
# The CPU path needs no CUDA toolkit: configures the project with MESHDDP_ENABLE_CUDA=OFF and no
# Thrust headers (as on a machine without the toolkit), checks CMake chose the CPU-only torch and
# the plain-loop CPU kernels, and compiles the CPU kernels' source in that mode (torch-free, ~2 s).
# Usage: check_cpu_only_configure.sh SOURCE_DIR PYTHON WORK_DIR [JSON_INCLUDE_DIR (the build's own)]
set -euo pipefail
src="$1" py="$2" dir="$3" json="${4:-}"
rm -rf "$dir"
cmake -S "$src" -B "$dir" -DMESHDDP_ENABLE_CUDA=OFF -DMESHDDP_THRUST_INCLUDE_DIR=NONE -DMESHDDP_BUILD_TESTS=OFF \
  -DMESHDDP_PYTHON="$py" ${json:+-DMESHDDP_JSON_INCLUDE_DIR="$json"} >"$dir.log" 2>&1 || { cat "$dir.log"; exit 1; }
grep -q "CPU-only build against the wheel's torch_cpu" "$dir.log" || { echo "not a CPU-only configure:"; cat "$dir.log"; exit 1; }
grep -q "no Thrust headers: CPU kernels run their functors in a plain loop" "$dir.log" || { cat "$dir.log"; exit 1; }
if grep -q "CMAKE_CUDA_COMPILER" "$dir/CMakeCache.txt" && grep -q "^CMAKE_CUDA_COMPILER:.*nvcc" "$dir/CMakeCache.txt"; then
  echo "CUDA was enabled despite MESHDDP_ENABLE_CUDA=OFF"; exit 1
fi
make -C "$dir/optimizer" fused_step_cpu.o >/dev/null
grep -q "MESHDDP_NO_THRUST" "$dir/optimizer/CMakeFiles/meshddp_optimizer.dir/flags.make" ||
  grep -rq "MESHDDP_NO_THRUST" "$dir/optimizer/CMakeFiles/meshddp_optimizer.dir/" || { echo "fused_step_cpu.cpp not built without Thrust"; exit 1; }
echo "CPU-only configure without CUDA or Thrust: ok"
