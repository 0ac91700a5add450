#!/usr/bin/env bash
# The C++ test suites (GoogleTest binaries) built with AddressSanitizer and UndefinedBehaviorSanitizer,
# into their own build directory (build-asan/, or MESHDDP_SANITIZE_BUILD_DIR), and run through ctest.
# Not part of scripts/test.sh's default run nor CI (it is a second whole build): run it on request,
# `scripts/sanitize.sh [ctest args]` or `MESHDDP_SANITIZE=1 scripts/test.sh [ctest args]`.
#   scripts/sanitize.sh                           # every C++ suite
#   MESHDDP_SANITIZE_TARGETS=pipeline_tests scripts/sanitize.sh -R 'PipelineTied\.'
# MESHDDP_SANITIZE_TARGETS: the test binaries to build (default: every C++ suite); ctest's arguments
# narrow what runs. Cases of binaries not built are left out (ctest's *_NOT_BUILT placeholders).
# MESHDDP_SANITIZE_JOBS: build jobs (default: every core).
# CPU only (-DMESHDDP_ENABLE_CUDA=OFF): the sanitizers instrument our host code; torch itself is not
# instrumented, so errors inside torch are not found, errors of ours that pass through it are.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
build="${MESHDDP_SANITIZE_BUILD_DIR:-$root/build-asan}"
flags="-fsanitize=address,undefined -fno-omit-frame-pointer"
if [ ! -f "$build/CMakeCache.txt" ]; then
  mkdir -p "$build"
  echo "[sanitize] configuring $build (log: $build/configure.log)" >&2
  # The precompiled headers are made with the same flags (CMAKE_CXX_FLAGS), so they stay on.
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMESHDDP_ENABLE_CUDA=OFF \
        -DCMAKE_CXX_FLAGS="$flags" \
        -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
        -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" 2>&1 | tee "$build/configure.log"
fi
targets="${MESHDDP_SANITIZE_TARGETS:-mesh_tests grad_buffer_tests checkpoint_tests common_tests optimizer_tests tp_tests plugin_tests checkpoint_saver_tests construction_tests pipeline_tests}"
jobs="${MESHDDP_SANITIZE_JOBS:-$(nproc)}"
echo "[sanitize] building $targets with $jobs jobs" >&2
# shellcheck disable=SC2086
cmake --build "$build" -j "$jobs" --target $targets
cd "$build"
# detect_leaks=0: torch's process-lifetime allocations (its registries, CPU allocator caches) are not ours.
# new_delete_type_mismatch: deleting through a base without a virtual destructor.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:new_delete_type_mismatch=1:abort_on_error=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
export CTEST_PARALLEL_LEVEL="${CTEST_PARALLEL_LEVEL:-2}"
# Only the GoogleTest cases: the Python, example, doc and build checks are not built here.
ctest --output-on-failure --timeout 1200 -E '^(python|examples|docs|build|style|bench)\.|_NOT_BUILT$' "$@"
