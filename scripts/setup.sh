#!/usr/bin/env bash
# Installs what meshddp needs into a project-local virtualenv (.venv): the PyPI wheel torch==2.11.0,
# whose LibTorch (headers, libs, CMake config, c10d, torchrun, pybind11) the build uses, the PyPI
# package nlohmann-json==3.12.0 (the JSON headers checkpoint/ uses: cmake/JsonFromWheel.cmake), plus
# scikit-build-core (builds the Python package), pytest and crc32c (the tests; they re-sign
# checkpoints they damage on purpose) and clang-format (pinned: the style check, scripts/check_format.sh). Idempotent: a ready
# .venv is reused (what it lacks of these is added), and pip's cache (~/.cache/pip) is reused when it
# is there.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MESHDDP_VENV:-$root/.venv}"
torch_version="2.11.0"
json_version="3.12.0"

# crc32c: the tests' CRC32C (they re-sign checkpoints they edit on purpose).
python_tools="scikit-build-core>=0.10 pytest crc32c==2.9.post0 clang-format==19.1.7 nlohmann-json==$json_version"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import torch,sys; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" 2>/dev/null; then
  # A .venv from before the Python package, the JSON headers or the style check: add what is missing
  # (never touching torch).
  { "$venv/bin/python" -c "import scikit_build_core, pytest, crc32c, sys; from importlib.metadata import version; sys.exit(version('nlohmann-json') != '$json_version')" 2>/dev/null &&
    "$venv/bin/clang-format" --version 2>/dev/null | grep -q "version 19.1.7"; } ||
    "$venv/bin/python" -m pip install --quiet --retries 10 --timeout 60 $python_tools
  exit 0
fi
echo "[setup] creating $venv with torch==$torch_version (first run only; a few minutes)" >&2
python3 -m venv "$venv"
# PyPI downloads of several hundred MB get cut off now and then (a CI run failed on one): pip resumes a
# cut download, and a failed install is retried whole, reusing pip's cache of what already arrived.
pip_install() {
  local attempt
  for attempt in 1 2 3 4; do
    "$venv/bin/python" -m pip install --retries 10 --timeout 60 "$@" && return 0
    echo "[setup] pip install failed (attempt $attempt of 4); retrying in $((attempt * 15)) s" >&2
    sleep $((attempt * 15))
  done
  echo "[setup] pip install failed 4 times: check the network or PyPI, then re-run scripts/setup.sh" >&2
  return 1
}
pip_install --quiet --upgrade pip
# pip >= 25.1 resumes an interrupted download; --resume-retries sets how often.
pip_install --resume-retries 20 --progress-bar on "torch==$torch_version" numpy matplotlib $python_tools >&2
"$venv/bin/python" -c "import torch; print('[setup] torch', torch.__version__, 'cuda', torch.version.cuda)" >&2
