#!/usr/bin/env bash
# Run HERE (a machine with Debian's package mirrors), before a device call: puts what the GPU machine
# lacks and cannot fetch (it has no network) into .gpu_deps/ (git-ignored), for the call to carry:
#   - googletest's source package (the device image has no GoogleTest; scripts/gpu_check.sh unpacks
#     it and CMake builds it: tests/CMakeLists.txt MESHDDP_GTEST_SOURCE_DIR);
#   - the nlohmann-json==3.12.0 wheel (the JSON headers checkpoint/ uses; scripts/gpu_check.sh installs
#     it offline into the device's Python, where cmake/JsonFromWheel.cmake finds it).
# torch, CMake, nvcc, pytest and scikit-build-core are in the device image already (docs/reference/gpu.md).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$root/.gpu_deps"
cd "$root/.gpu_deps"
ls googletest_*.deb >/dev/null 2>&1 || apt-get download googletest
ls nlohmann_json-3.12.0-*.whl >/dev/null 2>&1 ||
  "${MESHDDP_PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary :all: nlohmann-json==3.12.0 -d .
ls -l "$root/.gpu_deps"
