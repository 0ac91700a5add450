#!/usr/bin/env bash
# The C++ package as a user gets it: install the build tree into a fresh prefix, configure and build
# examples/04_cmake_consumer (its own project: find_package(meshddp CONFIG REQUIRED)) against that
# prefix only (with a trainer's own folders named like ours first on its include path), and run it on
# 2 ranks under torchrun; it checks its params against a one-process
# golden every step. Then a consumer pointed at a torch of another major.minor is refused at configure
# time, naming both versions, and one of another patch release is accepted.
# No compiler cache for the consumer: it sees meshddp's headers as system headers, which a cache set to
# skip those could take from another tree's install. Usage: check_cmake_consumer.sh <source dir> <build dir> <python of the venv holding torch> <work dir>
set -euo pipefail
# CMake reads these from the environment: a cache the caller set for its own build must not reach the consumer.
unset CMAKE_C_COMPILER_LAUNCHER CMAKE_CXX_COMPILER_LAUNCHER CMAKE_CUDA_COMPILER_LAUNCHER
src="$1" build="$2" python="$3" work="$4"
rm -rf "$work" && mkdir -p "$work"
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
test -f "$work/prefix/include/meshddp/meshddp.h"
test -f "$work/prefix/lib/cmake/meshddp/meshddpConfig.cmake"
# A trainer with folders named like ours on its own include path (searched first): every one of our
# header names there is an #error, so the build fails if one of our headers picks the trainer's.
(cd "$work/prefix/include/meshddp" && find mesh checkpoint grad_buffer tp optimizer plugin -name '*.h') |
  while read -r h; do mkdir -p "$work/shadow/$(dirname "$h")"; echo "#error the trainer's own $h was included" > "$work/shadow/$h"; done
cmake -S "$src/examples/04_cmake_consumer" -B "$work/consumer" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_CXX_FLAGS="-I$work/shadow" > "$work/configure.log"
grep -q "consumer: meshddp 0" "$work/configure.log"
cmake --build "$work/consumer" -j 2 > "$work/build.log" 2>&1 || { tail -30 "$work/build.log"; exit 1; }
torchrun="$(dirname "$python")/torchrun"
"$torchrun" --standalone --nproc-per-node 2 --no-python "$work/consumer/consumer" > "$work/run.log" 2>&1 || {
  cat "$work/run.log"; exit 1; }
test "$(grep -c 'consumer: ok' "$work/run.log")" = 2 || { cat "$work/run.log"; exit 1; }
echo "consumer built against the install tree and ran on 2 ranks: $(grep -c 'consumer: ok' "$work/run.log") ranks ok"

# A torch of another version: a fake torch dir whose version.py says so.
mkdir -p "$work/other_torch" && echo "__version__ = '9.9.9'" > "$work/other_torch/version.py"
if cmake -S "$src/examples/04_cmake_consumer" -B "$work/consumer_other" -DCMAKE_PREFIX_PATH="$work/prefix" \
         -DMESHDDP_TORCH_DIR="$work/other_torch" > "$work/other.log" 2>&1; then
  echo "a consumer against torch 9.9.9 configured; expected a refusal"; exit 1
fi
# CMake wraps the message at a width, so where the lines break depends on the build dir's path
# (a longer checkout path put "torch" and "9.9.9" on two lines): compare with the lines joined.
tr -s ' \n' ' ' < "$work/other.log" | grep -q "holds torch 9.9.9" || { cat "$work/other.log"; exit 1; }
echo "a torch of another version is refused at configure time: $(grep -o 'meshddp was built against torch [^,]*' "$work/other.log" | head -1)"

# The same major.minor and +flavour with another patch release is accepted (configure only): a copy of
# the torch dir made of links, with its own version.py.
real_torch="$("$python" -c 'import torch, os; print(os.path.dirname(torch.__file__))')"
mkdir -p "$work/patch_torch"
for f in "$real_torch"/*; do [ "$(basename "$f")" = version.py ] || ln -s "$f" "$work/patch_torch/"; done
flavour="$("$python" -c 'import torch; v = torch.__version__; print(v[v.index("+"):] if "+" in v else "")')"
echo "__version__ = '2.11.9$flavour'" > "$work/patch_torch/version.py"
cmake -S "$src/examples/04_cmake_consumer" -B "$work/consumer_patch" -DCMAKE_PREFIX_PATH="$work/prefix" \
      -DMESHDDP_TORCH_DIR="$work/patch_torch" > "$work/patch.log" 2>&1 || { cat "$work/patch.log"; exit 1; }
echo "a torch of the same major.minor and flavour (2.11.9$flavour) is accepted"
