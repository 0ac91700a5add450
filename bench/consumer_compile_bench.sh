#!/usr/bin/env bash
# A trainer's compile time against installed meshddp packages, side by side: for each install prefix,
# the C++ front end of a file holding only the includes (g++ -fsyntax-only with the flags
# meshddp::meshddp gives), and examples/04_cmake_consumer built cold and rebuilt after an edit of
# its one source, without and with meshddp_target_precompile_headers(). CPU seconds of the compiler
# (user, as /usr/bin/time reports them: wall time follows the machine's load), the median of REPS
# runs, the prefixes alternated run by run so that both see the same load. Prints a table, and the
# ratio of each prefix to the first. Results: docs/reference/building.md.
#
# Usage: bench/consumer_compile_bench.sh LABEL=PREFIX [LABEL=PREFIX ...]
#   PREFIX: a `cmake --install build --prefix PREFIX` of meshddp; torch: the repository's .venv.
#   REPS (default 3) runs of each measure; WORK (default /tmp/consumer_compile_bench) for the builds.
set -euo pipefail
unset CMAKE_C_COMPILER_LAUNCHER CMAKE_CXX_COMPILER_LAUNCHER CMAKE_CUDA_COMPILER_LAUNCHER  # no compiler cache
root="$(cd "$(dirname "$0")/.." && pwd)"
reps="${REPS:-3}" work="${WORK:-/tmp/consumer_compile_bench}"
[ $# -ge 1 ] || { sed -n 2,12p "$0"; exit 2; }
torch_cmake="$("$root/.venv/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
rm -rf "$work" && mkdir -p "$work/src"
cp "$root/examples/04_cmake_consumer/"* "$work/src/"
printf '#include <meshddp/meshddp.h>\n' > "$work/meshddp_only.cpp"
printf '#include <torch/torch.h>\n#include <meshddp/meshddp.h>\n' > "$work/torch_and_meshddp.cpp"

labels=() prefixes=()
for arg in "$@"; do labels+=("${arg%%=*}") prefixes+=("${arg#*=}"); done
user_s() { /usr/bin/time -f %U -o "$work/time" "$@" > /dev/null 2>&1; cat "$work/time"; }
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }  # "n/a" stays n/a

for i in "${!labels[@]}"; do
  for pch in OFF ON; do
    # A package older than meshddp_target_precompile_headers() does not configure with PCH: n/a.
    cmake -S "$work/src" -B "$work/${labels[$i]}_$pch" -DCMAKE_BUILD_TYPE=Release -DCONSUMER_PRECOMPILED_HEADERS=$pch \
          -DCMAKE_PREFIX_PATH="${prefixes[$i]};$torch_cmake" > "$work/${labels[$i]}_$pch.configure.log" 2>&1 ||
      { [ $pch = ON ] || { cat "$work/${labels[$i]}_$pch.configure.log"; exit 1; }; rm -rf "$work/${labels[$i]}_$pch"; }
  done
done
declare -A samples
for ((r = 0; r < reps; ++r)); do
  for i in "${!labels[@]}"; do
    l="${labels[$i]}" flags="$work/${labels[$i]}_OFF/CMakeFiles/consumer.dir/flags.make"
    defs="$(sed -n 's/^CXX_DEFINES = //p' "$flags")" incs="$(sed -n 's/^CXX_INCLUDES = //p' "$flags")"
    for f in meshddp_only torch_and_meshddp; do
      # shellcheck disable=SC2086
      samples[$l,$f]+=" $(user_s g++ -std=gnu++20 -O3 -DNDEBUG $defs $incs -fsyntax-only "$work/$f.cpp")"
    done
    for pch in OFF ON; do
      b="$work/${l}_$pch"
      [ -d "$b" ] || { samples[$l,cold_$pch]+=" n/a" samples[$l,rebuild_$pch]+=" n/a"; continue; }
      cmake --build "$b" --target clean > /dev/null
      samples[$l,cold_$pch]+=" $(user_s cmake --build "$b" -j1)"
      touch "$work/src/main.cpp"
      samples[$l,rebuild_$pch]+=" $(user_s cmake --build "$b" -j1)"
    done
  done
done

measures=(meshddp_only torch_and_meshddp cold_OFF rebuild_OFF cold_ON rebuild_ON)
echo "compiler CPU seconds (user), median of $reps; $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), $(g++ --version | head -1)"
printf '%-34s' "measure"; for l in "${labels[@]}"; do printf '%14s' "$l"; done
if [ ${#labels[@]} -gt 1 ]; then printf '%14s' "last/first"; fi; echo
for m in "${measures[@]}"; do
  case "$m" in
    meshddp_only) name="front end: <meshddp/meshddp.h>" ;;
    torch_and_meshddp) name="front end: torch.h + meshddp.h" ;;
    cold_OFF) name="example 04 cold, no PCH" ;;
    rebuild_OFF) name="example 04 after an edit, no PCH" ;;
    cold_ON) name="example 04 cold, PCH" ;;
    rebuild_ON) name="example 04 after an edit, PCH" ;;
  esac
  printf '%-34s' "$name"
  first=""
  for l in "${labels[@]}"; do
    # shellcheck disable=SC2086
    v="$(median ${samples[$l,$m]})"; printf '%14s' "$v"; last="$v"; [ -n "$first" ] || first="$v"
  done
  if [ ${#labels[@]} -gt 1 ]; then
    if [ "$last" = n/a ] || [ "$first" = n/a ]; then printf '%14s' "-"; else awk -v a="$last" -v b="$first" 'BEGIN {printf "%13.2fx", a / b}'; fi
  fi
  echo
done
