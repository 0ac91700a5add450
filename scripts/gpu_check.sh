#!/usr/bin/env bash
# The whole GPU check, made for the device tool's machine (one H100/H200, 16 cores, no network, a
# python3 that already holds torch 2.11.0, 10 minutes a command, 8 files back): build with CUDA,
# then the stages asked for, each step under a timeout, the whole run under a time budget.
#
# Usage: scripts/gpu_check.sh [STAGE...]      STAGE: tests | sanitizer | bench   (default: all three)
#   tests      the GPU tests (NCCL at world size 1 with every collective forced; 4 ranks on the one
#              GPU over Gloo with CUDA tensors), the fused kernels against ATen on CUDA, the Python
#              package's GPU suites (tests/python/test_gpu*.py), the NCCL blocking-wait path
#   sanitizer  compute-sanitizer memcheck, racecheck and synccheck on the world-size-1 GPU tests and
#              on the kernel tests
#   bench      fused_step_bench at 1e7/1e8/1e9 elements, ddp_bench --device cuda at world size 1 (the
#              MLP stack, and the ~1B bf16 GPT: meshddp / local against the 1.02 goal in summary.txt)
# Output (a directory: $MESHDDP_GPU_CHECK_DIR, else $OUT, else build/gpu_check), few files because
# the device tool brings back at most 8: summary.txt (a line per step: ok / FAILED / TIMEOUT /
# NOT RUN, seconds), gpu_check.log (every step's output, in order), versions.txt, and the benches'
# JSON. Exit status: non-zero if any step failed or did not run.
#
# Environment: MESHDDP_GPU_CHECK_BUDGET_S (default 540: stop starting steps after this many seconds,
# so a 600 s device call still returns its summary); MESHDDP_GPU_CHECK_DRY_RUN=1 runs without a GPU
# (checks this script's flow on a CPU machine: every GPU test then skips and is reported so;
# timeouts and the budget x10; a missing compute-sanitizer is reported, not failed).
# GoogleTest on a machine without it: `bash scripts/gpu_deps.sh` here first (downloads its source
# package into .gpu_deps/), then carry .gpu_deps with the device call (docs/reference/gpu.md "Running the check").
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${MESHDDP_GPU_CHECK_DIR:-${OUT:-$root/build/gpu_check}}"
build="${MESHDDP_BUILD_DIR:-$root/build}"
budget="${MESHDDP_GPU_CHECK_BUDGET_S:-540}"
dry_run="${MESHDDP_GPU_CHECK_DRY_RUN:-0}"
timeout_scale=1; [ "$dry_run" = 1 ] && timeout_scale=10  # a 2-core CPU machine builds slower
budget=$((budget * timeout_scale))                        # the budget too (its build alone may pass 540 s)
stages=("$@")
[ "${#stages[@]}" -gt 0 ] || stages=(tests sanitizer bench)
for s in "${stages[@]}"; do
  case "$s" in tests|sanitizer|bench) ;; *) echo "gpu_check: unknown stage '$s' (tests, sanitizer, bench)" >&2; exit 2 ;; esac
done
mkdir -p "$out"
log="$out/gpu_check.log" summary="$out/summary.txt"
: >"$log"; : >"$summary"
started=$SECONDS
failed=()

note() { echo "[gpu_check] $*" | tee -a "$log" >&2; }
# step NAME TIMEOUT_S COMMAND...: runs it (output appended to the log), one summary line.
step() {
  local name="$1" limit=$(($2 * timeout_scale)); shift 2
  if [ $((SECONDS - started)) -ge "$budget" ]; then
    echo "$name: NOT RUN (time budget of ${budget}s spent)" >>"$summary"; failed+=("$name"); return
  fi
  note "$name (timeout ${limit}s): $*"
  local t0=$SECONDS rc
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1; rc=$?
  local took=$((SECONDS - t0)) result=ok
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then result="TIMEOUT"; elif [ "$rc" -ne 0 ]; then result="FAILED (exit $rc)"; fi
  [ "$result" = ok ] || failed+=("$name")
  echo "$name: $result, ${took}s" >>"$summary"
  note "$name: $result, ${took}s"
}
finish() {
  echo "total: $((SECONDS - started))s; stages: ${stages[*]}" >>"$summary"
  echo "==== summary ($out/summary.txt)" >&2; cat "$summary" >&2
  if [ "${#failed[@]}" -gt 0 ]; then echo "gpu_check: FAILED or not run: ${failed[*]} (log: $log)" >&2; exit 1; fi
  echo "gpu_check: all passed (log: $log)" >&2; exit 0
}

# ratio JSON A B [GOAL]: "A / B = x" of ddp_bench's median step times, and whether x <= GOAL.
ratio() {
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

# --- the machine -----------------------------------------------------------------------------------
if [ "$dry_run" != 1 ]; then
  nvidia-smi >>"$log" 2>&1 || { echo "gpu_check: no GPU visible (nvidia-smi failed); MESHDDP_GPU_CHECK_DRY_RUN=1 checks the flow without one" | tee -a "$summary" >&2; exit 1; }
fi
# No network there: use a python3 that already holds torch 2.11.0 (the device image's) as .venv.
if [ ! -e "$root/.venv" ] && python3 -c "import torch, scikit_build_core, pytest, sys; sys.exit(torch.__version__.split('+')[0] != '2.11.0')" 2>/dev/null; then
  ln -s "$(python3 -c 'import sys; print(sys.prefix)')" "$root/.venv"
  note "using $(readlink "$root/.venv") as .venv (its torch 2.11.0; nothing installed)"
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1; nvcc --version 2>&1 | tail -2; g++ --version | head -1
  "$root/.venv/bin/python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else 'n/a')" 2>&1
} >"$out/versions.txt"

# --- build (only the targets the stages need) ------------------------------------------------------
configure_args=(-DMESHDDP_ENABLE_CUDA=ON)
gtest_deb="$(ls "$root"/.gpu_deps/googletest_*.deb 2>/dev/null | head -1)"
if [ -n "$gtest_deb" ]; then
  rm -rf "$build/gtest_src" && mkdir -p "$build/gtest_src" && dpkg-deb -x "$gtest_deb" "$build/gtest_src"
  configure_args+=("-DMESHDDP_GTEST_SOURCE_DIR=$build/gtest_src/usr/src/googletest")
fi
targets=()
for s in "${stages[@]}"; do
  case "$s" in
    tests) targets+=(gpu_tests optimizer_tests grad_buffer_tests meshddp_python) ;;
    sanitizer) targets+=(gpu_tests optimizer_tests grad_buffer_tests) ;;
    bench) targets+=(ddp_bench fused_step_bench) ;;
  esac
done
# The JSON headers (scripts/gpu_deps.sh carried the wheel): installed offline, so setup.sh finds them.
json_wheel="$(ls "$root"/.gpu_deps/nlohmann_json-3.12.0-*.whl 2>/dev/null | head -1)"
if [ -n "$json_wheel" ]; then
  PIP_BREAK_SYSTEM_PACKAGES=1 "$root/.venv/bin/python" -m pip install --quiet --no-deps --no-index "$json_wheel" >>"$log" 2>&1 ||
    note "installing $json_wheel failed (see the log)"
fi
# Set-up and configure (no timeout needed: no network, seconds), then the build under its timeout.
if ! bash "$root/scripts/setup.sh" >>"$log" 2>&1; then
  echo "setup: FAILED (no .venv with torch 2.11.0 and no network to make one; see the log)" >>"$summary"; failed+=(setup); finish
fi
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo "${configure_args[@]}" >>"$log" 2>&1 ||
    { echo "configure: FAILED (see the log)" >>"$summary"; failed+=(configure); finish; }
fi
grep -q "^CMAKE_CUDA_COMPILER:[A-Z]*=.*nvcc" "$build/CMakeCache.txt" ||
  { echo "configure: FAILED (CMake found no nvcc: the CUDA parts and gpu_tests are not built)" >>"$summary"; failed+=(configure); finish; }
# The Python module is configured only where the python has its development headers (Python.h).
python_module=1
if [ ! -d "$build/plugin/python/CMakeFiles/meshddp_python.dir" ]; then
  python_module=0 targets=("${targets[@]/meshddp_python/}")
fi
step build 420 cmake --build "$build" -j "$(nproc)" --target $(printf '%s\n' "${targets[@]}" | sort -u)
if [[ " ${failed[*]} " == *" build "* ]]; then finish; fi
tests="$build/tests"

# --- stages ----------------------------------------------------------------------------------------
for s in "${stages[@]}"; do
  case "$s" in
  tests)
    # A skip means torch saw no device: counted as a failure unless this is a dry run.
    MESHDDP_FORCE_COLLECTIVES=1 step gpu_tests 240 "$tests/gpu_tests"
    MESHDDP_FORCE_COLLECTIVES=1 step kernel_tests_cuda 180 "$tests/optimizer_tests" --gtest_filter='FusedStepCuda.*:DistributedOptimizer.Fused*'
    step nonfinite_count_tests_cuda 60 "$tests/grad_buffer_tests" --gtest_filter='NonfiniteCount*:CheckForNan*'
    # The Python package on the GPU (torch's NCCL DeviceMesh); a skip fails it unless this is a dry run.
    require_gpu=1; [ "$dry_run" = 1 ] && require_gpu=0
    if [ "$python_module" = 0 ]; then
      echo "python_gpu*: NOT RUN (no Python development headers for .venv's python: CMake did not configure the module)" >>"$summary"
    else
    # test_gpu.py: DDP and ZeRO-1 on NCCL; test_gpu_compile.py: torch.compile with inductor (Triton
    # kernels: the compile is most of its time); test_gpu_muon.py: Muon's Newton-Schulz on cuBLAS;
    # test_gpu_dcp.py: torch.distributed.checkpoint of CUDA state, resumed on the GPU and on CPU.
    for suite in gpu:240 gpu_compile:300 gpu_muon:180 gpu_dcp:180; do
      step "python_${suite%%:*}" "${suite##*:}" env PYTHONPATH="$build/plugin/python" MESHDDP_REQUIRE_GPU="$require_gpu" \
        "$root/.venv/bin/python" -m pytest -q -p no:cacheprovider -rs "$root/tests/python/test_${suite%%:*}.py"
    done
    fi
    # The NCCL blocking-wait path (Note [Waiting on NCCL]) on the world-size-1 tests.
    MESHDDP_FORCE_COLLECTIVES=1 MESHDDP_NCCL_BLOCKING_WAIT=1 step gpu_tests_blocking_wait 120 "$tests/gpu_tests" --gtest_filter='*WorldSizeOne*'
    skipped="$(grep -c "^\[  SKIPPED \]" "$log")"
    echo "tests skipped (no CUDA device seen by torch): $skipped" >>"$summary"
    if [ "$skipped" -gt 0 ] && [ "$dry_run" != 1 ]; then failed+=(skipped_tests); fi
    ;;
  sanitizer)
    sanitizer="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
    if [ ! -x "$sanitizer" ]; then
      echo "sanitizer: NOT RUN (no compute-sanitizer on PATH nor at $sanitizer)" >>"$summary"
      [ "$dry_run" = 1 ] || failed+=(sanitizer)  # a CPU machine may lack the tool; a GPU run needs it
      continue
    fi
    # API-error reports off (NCCL probes driver entry points that do not exist: not our errors) and a
    # bounded report count (the log must come back). memcheck runs without the caching allocator, so
    # an access past a tensor's end is outside any allocation. The kernel tests run mostly our kernels:
    # every tool checks all of them. On gpu_tests racecheck and synccheck look at meshddp's kernels
    # only (names containing meshddp::, e.g. CUB's kernels over our functors), not cuBLAS's or NCCL's.
    san=("$sanitizer" --error-exitcode 3 --report-api-errors no --print-limit 20)
    for tool in memcheck synccheck racecheck; do
      caching=(); [ "$tool" = memcheck ] && caching=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1)
      MESHDDP_FORCE_COLLECTIVES=1 step "sanitizer_${tool}_kernels" 90 "${caching[@]}" "${san[@]}" --tool "$tool" "$tests/optimizer_tests" --gtest_filter='FusedStepCuda.*'
      step "sanitizer_${tool}_nonfinite_count" 60 "${caching[@]}" "${san[@]}" --tool "$tool" "$tests/grad_buffer_tests" --gtest_filter='NonfiniteCountCuda.*'
    done
    for tool in memcheck synccheck racecheck; do
      caching=(); [ "$tool" = memcheck ] && caching=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1)
      ours=(); [ "$tool" != memcheck ] && ours=(--kernel-name kns=meshddp)
      MESHDDP_FORCE_COLLECTIVES=1 step "sanitizer_${tool}_gpu_tests" 150 "${caching[@]}" "${san[@]}" --tool "$tool" "${ours[@]}" "$tests/gpu_tests" --gtest_filter='*WorldSizeOne*'
    done
    ;;
  bench)
    device=cuda small=0; [ "$dry_run" = 1 ] && device=cpu small=1  # a dry run: tiny sizes on CPU
    numels=10000000,100000000,1000000000; [ "$small" = 1 ] && numels=100003
    ddp_env=(env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29533)
    # Issue 10's ratio first (the budget may not reach the last steps): meshddp / local at world size 1
    # on the ~1B-parameter bf16 GPT (--preset gpt1b: 1.04e9 params, batch 8 x 1024 tokens; memory
    # arithmetic in bench/bench_flags.cpp), beside meshddp_fp32_grads (Megatron's bf16 default); then
    # the fused step at 1e7..1e9; then with every collective forced (NCCL live on its stream at DP 1)
    # and ZeRO-1 in place of meshddp_fp32_grads (docs/reference/gpu.md); last the MLP with every candidate.
    gpt=(--preset gpt1b --warmup 3 --reps 20); [ "$small" = 1 ] && gpt=(--model gpt --layers 2 --hidden 64 --heads 2 --seq 16 --vocab 128 --batch 2 --warmup 1 --reps 2)
    gpt+=(--device "$device" --dtype bf16 --collective-reps 0)
    step ddp_bench_gpt1b 300 "${ddp_env[@]}" MASTER_PORT=29534 "$build/bench/ddp_bench" "${gpt[@]}" \
      --candidates local,meshddp,meshddp_fp32_grads --json "$out/ddp_bench_gpt1b.json"
    step fused_step_bench 240 "$build/bench/fused_step_bench" --device "$device" --numel "$numels" --reps 10
    step ddp_bench_gpt1b_forced 300 "${ddp_env[@]}" MASTER_PORT=29535 MESHDDP_FORCE_COLLECTIVES=1 "$build/bench/ddp_bench" "${gpt[@]}" \
      --candidates local,meshddp,meshddp_zero1 --json "$out/ddp_bench_gpt1b_forced.json"
    mlp=(--layers 16 --hidden 4096 --batch 16 --reps 20); [ "$small" = 1 ] && mlp=(--layers 2 --hidden 64 --batch 8 --reps 2 --warmup 1)
    step ddp_bench_mlp 240 "${ddp_env[@]}" "$build/bench/ddp_bench" --device "$device" "${mlp[@]}" --collective-reps 0 \
      --json "$out/ddp_bench_mlp.json"
    { ratio "$out/ddp_bench_gpt1b.json" meshddp local 1.02   # the ~1B preset's goal
      ratio "$out/ddp_bench_gpt1b.json" meshddp_fp32_grads local
      ratio "$out/ddp_bench_gpt1b_forced.json" meshddp local 1.02
      ratio "$out/ddp_bench_gpt1b_forced.json" meshddp_zero1 local
      ratio "$out/ddp_bench_mlp.json" meshddp local
    } >>"$summary"
    ;;
  esac
done
finish
