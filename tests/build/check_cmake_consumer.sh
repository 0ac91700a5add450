#!/usr/bin/env bash
# The C++ package as a user gets it: install the build tree into a prefix, move the prefix to another
# directory, and check that no text file of it names the build's paths (source, build tree, venv).
# Then configure and build examples/04_cmake_consumer (its own project: find_package(meshddp CONFIG
# REQUIRED)) against the moved prefix and a torch found only through the consumer's CMAKE_PREFIX_PATH:
# the venv's torch (and nvidia wheels) hard-linked into another directory, so the venv's path is on
# none of the consumer's command lines, cache entries or RUNPATH (checked); with a trainer's own
# folders named like ours first on its include path, compiled with the precompiled header of
# meshddp_target_precompile_headers() (checked); and run it on 2 ranks under torchrun; it checks its
# params against a one-process golden every step. Then: a consumer with no torch on its
# CMAKE_PREFIX_PATH is refused naming the way out; one pointed at a torch of another major.minor is
# refused at configure time, naming both versions; one of another patch release is accepted.
# No compiler cache for the consumer: it sees meshddp's headers as system headers, which a cache set to
# skip those could take from another tree's install. Usage: check_cmake_consumer.sh <source dir> <build dir> <python of the venv holding torch> <work dir>
set -euo pipefail
# CMake reads these from the environment: a cache the caller set for its own build must not reach the consumer.
unset CMAKE_C_COMPILER_LAUNCHER CMAKE_CXX_COMPILER_LAUNCHER CMAKE_CUDA_COMPILER_LAUNCHER
src="$1" build="$2" python="$3" work="$4"
unset CMAKE_PREFIX_PATH  # the consumer's search path is the one given below, nothing from the caller
rm -rf "$work" && mkdir -p "$work"
# Installed into one prefix, then moved to another directory.
cmake --install "$build" --prefix "$work/staging/prefix" > "$work/install.log"
mkdir -p "$work/moved" && mv "$work/staging/prefix" "$work/moved/prefix" && rmdir "$work/staging"
prefix="$work/moved/prefix"
test -f "$prefix/include/meshddp/meshddp.h"
test -f "$prefix/lib/cmake/meshddp/meshddpConfig.cmake"
venv_site="$(dirname "$("$python" -c 'import torch, os; print(os.path.dirname(torch.__file__))')")"
# Text files only (-I): the static libraries' debug line tables name the sources, as any build's do.
if grep -rIl -e "$src" -e "$build" -e "$venv_site" -e "$work/staging" "$prefix" > "$work/baked.txt"; then
  echo "the installed package names a path of the build machine (expected none: it must work moved):"
  grep -rIn -e "$src" -e "$build" -e "$venv_site" -e "$work/staging" "$prefix" | head -20; exit 1
fi
echo "no installed text file names the source, build, venv or install path"

# The consumer's torch: the venv's torch and nvidia (NCCL, CUDA runtime) wheels in another directory,
# hard-linked (a copy without the space; symlinks where the filesystem refuses hard links).
site="$work/elsewhere/site-packages"
mkdir -p "$site"
for pkg in torch nvidia; do
  if [ -d "$venv_site/$pkg" ]; then cp -al "$venv_site/$pkg" "$site/" 2>/dev/null || cp -as "$venv_site/$pkg" "$site/"; fi
done
torch_cmake="$site/torch/share/cmake"

# No torch on the consumer's CMAKE_PREFIX_PATH: refused, naming the way out.
if cmake -S "$src/examples/04_cmake_consumer" -B "$work/consumer_no_torch" -DCMAKE_PREFIX_PATH="$prefix" \
         > "$work/no_torch.log" 2>&1; then
  echo "a consumer with no torch on its CMAKE_PREFIX_PATH configured; expected a refusal"; exit 1
fi
tr -s ' \n' ' ' < "$work/no_torch.log" | grep -q "found no torch: none on CMAKE_PREFIX_PATH" || { cat "$work/no_torch.log"; exit 1; }
echo "a consumer with no torch on its CMAKE_PREFIX_PATH is refused, naming torch.utils.cmake_prefix_path"

# A trainer with folders named like ours on its own include path (searched first): every one of our
# header names there is an #error, so the build fails if one of our headers picks the trainer's.
(cd "$prefix/include/meshddp" && find mesh checkpoint grad_buffer common tp optimizer plugin -name '*.h') |
  while read -r h; do mkdir -p "$work/shadow/$(dirname "$h")"; echo "#error the trainer's own $h was included" > "$work/shadow/$h"; done
cmake -S "$src/examples/04_cmake_consumer" -B "$work/consumer" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$prefix;$torch_cmake" -DCMAKE_CXX_FLAGS="-I$work/shadow" > "$work/configure.log"
grep -q "consumer: meshddp 0" "$work/configure.log"
cmake --build "$work/consumer" -j 2 > "$work/build.log" 2>&1 || { tail -30 "$work/build.log"; exit 1; }
# The example calls meshddp_target_precompile_headers(): its source was compiled with the header made.
pch="$(find "$work/consumer/CMakeFiles/consumer.dir" -name 'cmake_pch.hxx.gch' | head -1)"
[ -n "$pch" ] || { echo "the consumer's precompiled header (meshddp_target_precompile_headers) was not made"; exit 1; }
grep -q "cmake_pch.hxx" "$work/consumer/CMakeFiles/consumer.dir/flags.make" ||
  { echo "the consumer's sources are not compiled with the precompiled header"; exit 1; }
echo "the consumer was built with meshddp_target_precompile_headers()'s header ($(du -h "$pch" | cut -f1))"
# The venv and the install's first place are on none of the consumer's command lines, cache entries or RUNPATH.
if grep -rIl -e "$venv_site" -e "$work/staging" "$work/consumer" > "$work/venv_refs.txt"; then
  echo "the consumer's build names the build machine's venv or the install's first place (expected only the given paths):"
  grep -rIn -e "$venv_site" -e "$work/staging" "$work/consumer" | head -20; exit 1
fi
runpath="$(readelf -d "$work/consumer/consumer" | grep -E 'RPATH|RUNPATH' || true)"
case "$runpath" in *"$venv_site"*) echo "the consumer's RUNPATH names the venv: $runpath"; exit 1 ;; esac
case "$runpath" in *"$site/torch/lib"*) ;; *) echo "the consumer's RUNPATH lacks the given torch's lib: $runpath"; exit 1 ;; esac
torchrun="$(dirname "$python")/torchrun"
"$torchrun" --standalone --nproc-per-node 2 --no-python "$work/consumer/consumer" > "$work/run.log" 2>&1 || {
  cat "$work/run.log"; exit 1; }
test "$(grep -c 'consumer: ok' "$work/run.log")" = 2 || { cat "$work/run.log"; exit 1; }
echo "consumer built against the moved install and a torch found through CMAKE_PREFIX_PATH only, ran on 2 ranks: $(grep -c 'consumer: ok' "$work/run.log") ranks ok"

# A torch of another version: a fake torch dir whose version.py says so.
mkdir -p "$work/other_torch" && echo "__version__ = '9.9.9'" > "$work/other_torch/version.py"
if cmake -S "$src/examples/04_cmake_consumer" -B "$work/consumer_other" -DCMAKE_PREFIX_PATH="$prefix;$torch_cmake" \
         -DMESHDDP_TORCH_DIR="$work/other_torch" > "$work/other.log" 2>&1; then
  echo "a consumer against torch 9.9.9 configured; expected a refusal"; exit 1
fi
# CMake wraps the message at a width, so where the lines break depends on the build dir's path
# (a longer checkout path put "torch" and "9.9.9" on two lines): compare with the lines joined.
tr -s ' \n' ' ' < "$work/other.log" | grep -q "holds torch 9.9.9" || { cat "$work/other.log"; exit 1; }
echo "a torch of another version is refused at configure time: $(grep -o 'meshddp was built against torch [^,]*' "$work/other.log" | head -1)"

# The same major.minor and +flavour with another patch release is accepted (configure only): a copy of
# the torch dir made of links, with its own version.py, found through CMAKE_PREFIX_PATH (the nvidia
# wheels beside it, as in a venv).
mkdir -p "$work/patch_site/torch"
for f in "$site/torch"/*; do [ "$(basename "$f")" = version.py ] || ln -s "$f" "$work/patch_site/torch/"; done
[ ! -d "$site/nvidia" ] || ln -s "$site/nvidia" "$work/patch_site/nvidia"
flavour="$("$python" -c 'import torch; v = torch.__version__; print(v[v.index("+"):] if "+" in v else "")')"
echo "__version__ = '2.11.9$flavour'" > "$work/patch_site/torch/version.py"
cmake -S "$src/examples/04_cmake_consumer" -B "$work/consumer_patch" \
      -DCMAKE_PREFIX_PATH="$prefix;$work/patch_site/torch/share/cmake" > "$work/patch.log" 2>&1 || { cat "$work/patch.log"; exit 1; }
grep -q "built against torch" "$work/patch.log" || { cat "$work/patch.log"; exit 1; }
echo "a torch of the same major.minor and flavour (2.11.9$flavour), found through CMAKE_PREFIX_PATH, is accepted"
