#!/usr/bin/env bash
# Checks that every C++/CUDA source of meshddp satisfies .clang-format (the pinned clang-format from
# PyPI that scripts/setup.sh installs into .venv, so every machine formats alike). --fix rewrites
# the files instead. third_party/ is not ours and is left alone.
# Usage: scripts/check_format.sh [--fix]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MESHDDP_VENV:-$root/.venv}"
clang_format="$venv/bin/clang-format"
want="19.1.7"
if ! "$clang_format" --version 2>/dev/null | grep -q "version $want"; then
  echo "check_format: $clang_format is not clang-format $want; run scripts/setup.sh (it installs clang-format==$want)" >&2
  exit 2
fi
cd "$root"
mapfile -t files < <(git ls-files '*.h' '*.cpp' '*.cu' '*.cuh' | grep -v '^third_party/')
if [ "${1:-}" = "--fix" ]; then
  "$clang_format" -i "${files[@]}"
  echo "check_format: formatted ${#files[@]} files"
  exit 0
fi
if ! "$clang_format" --dry-run --Werror "${files[@]}" 2> "${TMPDIR:-/tmp}/meshddp_format.log"; then
  grep -E '^[^ ].*: error:' "${TMPDIR:-/tmp}/meshddp_format.log" | sed -E 's/:[0-9]+:[0-9]+: error:.*//' | sort -u | head -50 >&2
  echo "check_format: the files above do not satisfy .clang-format; run scripts/check_format.sh --fix" >&2
  exit 1
fi
echo "check_format: ${#files[@]} files satisfy .clang-format (clang-format $want)"
