#!/usr/bin/env bash
# The whole GPU check, for a machine with a CUDA device (e.g. one H100/H200): build with CUDA, run
# the GPU tests and the fused-kernel tests on CUDA, compute-sanitizer (memcheck, racecheck,
# synccheck) on them, the measurements issue 10 asks for, then the CPU suite. Logs and figures go
# to the directory given as $1, else $OUT, else build/gpu_check; docs/gpu.md says what to copy where.
# Usage: scripts/gpu_check.sh [LOG_DIR]     (needs nvcc and a GPU; installs .venv like scripts/test.sh)
# Steps after the tests keep going when one fails; the exit status is non-zero if any failed.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-${OUT:-$root/build/gpu_check}}"
build="${MESHDDP_BUILD_DIR:-$root/build}"
mkdir -p "$out"
failed=()
step() {  # step NAME COMMAND...: runs it with its output in $out/NAME.txt, notes a failure
  local name="$1"; shift
  echo "[gpu_check] $name" >&2
  if "$@" >"$out/$name.txt" 2>&1; then echo "[gpu_check] $name: ok" >&2; else echo "[gpu_check] $name: FAILED (see $out/$name.txt)" >&2; failed+=("$name"); fi
}

nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || { echo "gpu_check: no GPU visible (nvidia-smi failed)" >&2; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvcc --version | tail -2;
  "$root/.venv/bin/python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())" 2>/dev/null
} >"$out/versions.txt" 2>&1
bash "$root/scripts/build.sh" -DMESHDDP_ENABLE_CUDA=ON >"$out/build.txt" 2>&1 || { echo "gpu_check: build failed, see $out/build.txt" >&2; exit 1; }
test -x "$build/tests/gpu_tests" || { echo "gpu_check: gpu_tests was not built (no nvcc at configure time?)" >&2; exit 1; }
tests="$build/tests"

# 1. The GPU tests (NCCL at world size 1 with every collective forced, 4 ranks on one GPU over
#    Gloo) and the fused kernels on CUDA. A skip means torch saw no device: a failure here.
export MESHDDP_FORCE_COLLECTIVES=1
step gpu_tests "$tests/gpu_tests"
step kernel_tests_cuda "$tests/optimizer_tests" --gtest_filter='FusedStep*:DistributedOptimizer.Fused*'
if grep -q "SKIPPED \]" "$out/gpu_tests.txt" "$out/kernel_tests_cuda.txt"; then
  echo "[gpu_check] tests SKIPPED: no CUDA device seen by torch" >&2; failed+=(skipped)
fi
# The NCCL blocking-wait path (Note [Waiting on NCCL]) on the same tests.
MESHDDP_NCCL_BLOCKING_WAIT=1 step gpu_tests_blocking_wait "$tests/gpu_tests" --gtest_filter='*WorldSizeOne*'

# 2. compute-sanitizer on the world-size-1 GPU tests and the CUDA kernel tests.
sanitizer="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
for tool in memcheck racecheck synccheck; do
  step "sanitizer_${tool}_gpu_tests" "$sanitizer" --tool "$tool" --error-exitcode 3 "$tests/gpu_tests" --gtest_filter='*WorldSizeOne*'
  step "sanitizer_${tool}_kernels" "$sanitizer" --tool "$tool" --error-exitcode 3 "$tests/optimizer_tests" --gtest_filter='FusedStepCuda.*'
done
unset MESHDDP_FORCE_COLLECTIVES

# 3. Measurements (docs/gpu.md lists what to record from each file).
step fused_step_bench "$build/bench/fused_step_bench" --device cuda --numel 10000000,100000000,1000000000 --reps 10
step ddp_bench_cuda env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 \
  "$build/bench/ddp_bench" --device cuda --layers 16 --hidden 4096 --batch 16 --reps 20 --json "$out/ddp_bench_cuda.json"
# Issue 10's ratio: meshddp / local step time at world size 1 on the ~1B-parameter bf16 GPT (--preset
# gpt1b: 1.04e9 params, batch 8 x 1024 tokens; its memory arithmetic is in bench/ddp_bench.cpp), with
# meshddp_fp32_grads (fp32 main grads and masters, Megatron's bf16 default) beside it. Then the same
# with every collective forced (MESHDDP_FORCE_COLLECTIVES=1: at DP 1 meshddp otherwise skips them, so
# this is the overlap machinery's cost with NCCL live on its stream), with ZeRO-1 (reduce-scatter,
# fp32 masters, all-gather) in place of meshddp_fp32_grads.
gpt1b=(--device cuda --preset gpt1b --dtype bf16 --warmup 3 --reps 20 --collective-reps 0)
step ddp_bench_gpt1b env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29534 \
  "$build/bench/ddp_bench" "${gpt1b[@]}" --candidates local,meshddp,meshddp_fp32_grads --json "$out/ddp_bench_gpt1b.json"
step ddp_bench_gpt1b_forced env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29535 \
  MESHDDP_FORCE_COLLECTIVES=1 "$build/bench/ddp_bench" "${gpt1b[@]}" --candidates local,meshddp,meshddp_zero1 \
  --json "$out/ddp_bench_gpt1b_forced.json"

# 4. The CPU suite, for good measure.
step ctest bash -c "cd '$build' && ctest --timeout 600"

# Summary of the ratios against issue 10's goal (also in $out/summary.txt).
ratio() {  # ratio JSON A B [GOAL]: "A / B = x" of ddp_bench's median step times, and whether x <= GOAL
  "$root/.venv/bin/python" - "$@" <<'PY' 2>&1
import json, sys
path, a, b, goal = (sys.argv[1:] + [""])[:4]
try:
    med = {c["name"]: c["median_ms"]["total"] for c in json.load(open(path))["candidates"]}
    r = med[a] / med[b]
    verdict = f"; goal <= {goal}: {'met' if r <= float(goal) else 'MISSED'}" if goal else ""
    print(f"{path.rsplit('/', 1)[-1]}: {a} / {b} = {r:.3f} ({med[a]:.1f} / {med[b]:.1f} ms{verdict})")
except (OSError, KeyError, ValueError, ZeroDivisionError) as e:
    print(f"{path}: no {a} / {b} ratio ({type(e).__name__}: {e})")
PY
}
{ ratio "$out/ddp_bench_gpt1b.json" meshddp local 1.02   # issue 10's figure
  ratio "$out/ddp_bench_gpt1b.json" meshddp_fp32_grads local
  ratio "$out/ddp_bench_gpt1b_forced.json" meshddp local 1.02
  ratio "$out/ddp_bench_gpt1b_forced.json" meshddp_zero1 local
  ratio "$out/ddp_bench_cuda.json" meshddp local
} | tee "$out/summary.txt" | sed 's/^/[gpu_check] /' >&2

if [ "${#failed[@]}" -gt 0 ]; then echo "gpu_check: FAILED: ${failed[*]} (logs in $out)" >&2; exit 1; fi
echo "gpu_check: all passed (logs in $out)" >&2
