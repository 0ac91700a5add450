#!/usr/bin/env bash
# The whole GPU check, on a machine with a CUDA device (e.g. the device tool's H100/H200):
# build with CUDA, run the GPU tests (which skip without a device), then compute-sanitizer memcheck
# and racecheck on them, then the CPU suite for good measure. Writes logs to ${OUT:-build/gpu_check}.
# Usage: scripts/gpu_check.sh            (needs nvcc; installs .venv like scripts/test.sh)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$root/build/gpu_check}"
mkdir -p "$out"
nvidia-smi | tee "$out/nvidia-smi.txt" || { echo "gpu_check: no GPU visible (nvidia-smi failed)"; exit 1; }
bash "$root/scripts/build.sh" -DMESHDDP_ENABLE_CUDA=ON 2>&1 | tail -3
tests="${MESHDDP_BUILD_DIR:-$root/build}/tests"
test -x "$tests/gpu_tests" || { echo "gpu_check: gpu_tests was not built (no nvcc at configure time?)"; exit 1; }
"$tests/gpu_tests" 2>&1 | tee "$out/gpu_tests.txt"
if grep -q SKIPPED "$out/gpu_tests.txt"; then echo "gpu_check: GPU tests skipped: no CUDA device seen by torch"; exit 1; fi
sanitizer="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
for tool in memcheck racecheck; do
  "$sanitizer" --tool "$tool" --error-exitcode 3 "$tests/gpu_tests" --gtest_filter='*WorldSizeOne*' \
    > "$out/sanitizer_$tool.txt" 2>&1 && echo "compute-sanitizer $tool: clean" || { echo "compute-sanitizer $tool: errors, see $out/sanitizer_$tool.txt"; exit 1; }
done
(cd "${MESHDDP_BUILD_DIR:-$root/build}" && ctest --timeout 600 2>&1 | tail -3) | tee "$out/ctest.txt"
