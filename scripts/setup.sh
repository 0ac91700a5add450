#!/usr/bin/env bash
# Installs what meshddp needs into a project-local virtualenv (.venv): the PyPI wheel torch==2.11.0,
# whose LibTorch (headers, libs, CMake config, c10d, torchrun, pybind11) the build uses, the PyPI
# package nlohmann-json==3.12.0 (the JSON headers checkpoint/ uses: cmake/JsonFromWheel.cmake), plus
# scikit-build-core (builds the Python package), pytest (its tests), crc32c (a dependency of the
# package) and clang-format (pinned: the style check, scripts/check_format.sh). Idempotent: a ready
# .venv is reused (what it lacks of these is added), and pip's cache (~/.cache/pip) is reused when it
# is there.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MESHDDP_VENV:-$root/.venv}"
torch_version="2.11.0"
json_version="3.12.0"

# crc32c: meshddp's dependency (pyproject.toml), hardware CRC32C for meshddp-consolidate; same pin.
python_tools="scikit-build-core>=0.10 pytest crc32c==2.9.post0 clang-format==19.1.7 nlohmann-json==$json_version"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import torch,sys; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" 2>/dev/null; then
  # A .venv from before the Python package, the JSON headers or the style check: add what is missing
  # (never touching torch).
  { "$venv/bin/python" -c "import scikit_build_core, pytest, crc32c, sys; from importlib.metadata import version; sys.exit(version('nlohmann-json') != '$json_version')" 2>/dev/null &&
    "$venv/bin/clang-format" --version 2>/dev/null | grep -q "version 19.1.7"; } ||
    "$venv/bin/python" -m pip install --quiet $python_tools
  exit 0
fi
echo "[setup] creating $venv with torch==$torch_version (first run only; a few minutes)" >&2
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --progress-bar on "torch==$torch_version" numpy matplotlib $python_tools >&2
"$venv/bin/python" -c "import torch; print('[setup] torch', torch.__version__, 'cuda', torch.version.cuda)" >&2
