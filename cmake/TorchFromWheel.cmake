# Finds LibTorch inside the PyPI wheel torch==2.11.0 installed by scripts/setup.sh (.venv), and
# defines meshddp::torch (what every target links) plus MESHDDP_WITH_CUDA.
#
# With nvcc present, the wheel's own TorchConfig is used (CUDA parts build). Without nvcc, the CUDA
# wheel's TorchConfig cannot be loaded (it requires a CUDA toolkit of the same major version), so the
# CPU libraries are imported by hand: the CPU build never needs a GPU, a driver or a toolkit.
#
# Pitfalls handled here (see docs/reference/building.md):
# - TORCH_CUDA_ARCH_LIST is set explicitly (auto-detection fails without a GPU).
# - CUDA::nvToolsExt (gone in CUDA 13) is defined as the header-only NVTX3 if the config asks for it.
# - nccl.h is not in the torch wheel: it comes from the nvidia-nccl wheel beside it, else the toolkit.
# - Our binaries link with --as-needed so none records a DT_NEEDED on libcuda (stub or real).
# - gloo's headers are not in the wheel either: third_party/gloo/include has the few that
#   ProcessGroupGloo.hpp parses (every gloo type there is held by pointer, so only declarations matter).

set(_meshddp_default_python "${PROJECT_SOURCE_DIR}/.venv/bin/python")
if(SKBUILD AND DEFINED Python_EXECUTABLE)  # `pip install .`: the Python running the build holds torch
  set(_meshddp_default_python "${Python_EXECUTABLE}")
endif()
set(MESHDDP_PYTHON "${_meshddp_default_python}" CACHE FILEPATH
    "Python of the virtualenv that holds torch==2.11.0 (made by scripts/setup.sh)")
if(NOT EXISTS "${MESHDDP_PYTHON}")
  message(FATAL_ERROR "meshddp: no Python at MESHDDP_PYTHON='${MESHDDP_PYTHON}'. "
                      "Run scripts/setup.sh first (it creates .venv with torch==2.11.0).")
endif()
execute_process(
  COMMAND "${MESHDDP_PYTHON}" -c "import torch, os; print(os.path.dirname(torch.__file__)); print(torch.__version__); print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"
  OUTPUT_VARIABLE _torch_info OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _torch_rc)
if(NOT _torch_rc EQUAL 0)
  message(FATAL_ERROR "meshddp: '${MESHDDP_PYTHON} -c \"import torch\"' failed; rerun scripts/setup.sh")
endif()
string(REPLACE "\n" ";" _torch_info "${_torch_info}")
list(GET _torch_info 0 MESHDDP_TORCH_DIR)
list(GET _torch_info 1 MESHDDP_TORCH_VERSION)
list(GET _torch_info 2 _torch_cxx11_abi)
message(STATUS "meshddp: torch ${MESHDDP_TORCH_VERSION} at ${MESHDDP_TORCH_DIR}")

include(CheckLanguage)
option(MESHDDP_ENABLE_CUDA "Build the CUDA parts when nvcc is found" ON)
set(MESHDDP_WITH_CUDA OFF)
if(MESHDDP_ENABLE_CUDA)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(MESHDDP_WITH_CUDA ON)
  endif()
endif()

add_library(meshddp_torch INTERFACE)
add_library(meshddp::torch ALIAS meshddp_torch)
# Ranks as threads and c10d's Gloo need these; the c10d headers compile to nothing without them.
# Its interface is the build tree's only ($<BUILD_INTERFACE:...>): the installed package gives its
# meshddp::torch the same interface from the torch recorded at build time (cmake/meshddpConfig.cmake.in).
set(MESHDDP_TORCH_DEFINITIONS USE_DISTRIBUTED USE_C10D_GLOO)

if(MESHDDP_WITH_CUDA)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90)
  endif()
  # Our .cu files are torch-free (optimizer/fused_step.cu); the shared runtime is the one torch loads.
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
  enable_language(CUDA)
  set(TORCH_CUDA_ARCH_LIST "9.0" CACHE STRING "CUDA archs for Torch's CMake config (no GPU to detect here)")
  find_package(CUDAToolkit REQUIRED)
  if(NOT TARGET CUDA::nvToolsExt)
    # CUDA 13 dropped libnvToolsExt; NVTX3 is header-only.
    add_library(CUDA::nvToolsExt INTERFACE IMPORTED)
    set_target_properties(CUDA::nvToolsExt PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${CUDAToolkit_INCLUDE_DIRS}")
  endif()
  list(APPEND CMAKE_PREFIX_PATH "${MESHDDP_TORCH_DIR}/share/cmake")
  find_package(Torch REQUIRED)
  target_link_libraries(meshddp_torch INTERFACE "$<BUILD_INTERFACE:${TORCH_LIBRARIES}>")
  list(APPEND MESHDDP_TORCH_DEFINITIONS MESHDDP_WITH_CUDA USE_C10D_NCCL)
  # nccl.h for ProcessGroupNCCL.hpp: the header of the NCCL torch loads (the nvidia-nccl wheel beside
  # torch), else the toolkit's (a GPU image may have no NCCL in its toolkit).
  find_path(MESHDDP_NCCL_INCLUDE_DIR nccl.h
    HINTS "${MESHDDP_TORCH_DIR}/../nvidia/nccl/include" ${CUDAToolkit_INCLUDE_DIRS}
    DOC "Directory holding nccl.h (the NCCL that torch's wheel ships)")
  if(NOT MESHDDP_NCCL_INCLUDE_DIR)
    message(FATAL_ERROR "meshddp: nccl.h not found beside torch (${MESHDDP_TORCH_DIR}/../nvidia/nccl/include) nor in "
                        "the CUDA toolkit; give -DMESHDDP_NCCL_INCLUDE_DIR=<dir with nccl.h> or -DMESHDDP_ENABLE_CUDA=OFF")
  endif()
  message(STATUS "meshddp: nccl.h from ${MESHDDP_NCCL_INCLUDE_DIR}")
  set(MESHDDP_TORCH_INCLUDE_DIRS "${MESHDDP_NCCL_INCLUDE_DIR}" ${CUDAToolkit_INCLUDE_DIRS})
else()
  message(STATUS "meshddp: no nvcc (or MESHDDP_ENABLE_CUDA=OFF): CPU-only build against the wheel's torch_cpu")
  set(MESHDDP_TORCH_INCLUDE_DIRS "${MESHDDP_TORCH_DIR}/include" "${MESHDDP_TORCH_DIR}/include/torch/csrc/api/include")
  list(APPEND MESHDDP_TORCH_DEFINITIONS _GLIBCXX_USE_CXX11_ABI=${_torch_cxx11_abi})
  target_link_libraries(meshddp_torch INTERFACE
    "$<BUILD_INTERFACE:${MESHDDP_TORCH_DIR}/lib/libtorch_cpu.so;${MESHDDP_TORCH_DIR}/lib/libc10.so>" Threads::Threads)
endif()

target_compile_definitions(meshddp_torch INTERFACE "$<BUILD_INTERFACE:${MESHDDP_TORCH_DEFINITIONS}>")
target_include_directories(meshddp_torch SYSTEM INTERFACE
  "$<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/third_party/gloo/include;${MESHDDP_TORCH_INCLUDE_DIRS}>")
# --as-needed for our own binaries only (no DT_NEEDED on libcuda), not imposed on a consumer.
target_link_options(meshddp_torch INTERFACE "$<BUILD_INTERFACE:LINKER:--as-needed>")

# Thrust/CUB/libcu++ headers (CCCL), for the CPU build of the kernels (Thrust's CPP system with the
# host compiler) and the CUDA build. They ship with the CUDA toolkit (CUDA 13: include/cccl). Not
# found (or -DMESHDDP_THRUST_INCLUDE_DIR=NONE): the CPU kernels run the same functors in a plain loop.
find_path(MESHDDP_THRUST_INCLUDE_DIR thrust/version.h
  HINTS ${CUDAToolkit_INCLUDE_DIRS} "$ENV{CUDA_HOME}/include" /usr/local/cuda/include
  PATH_SUFFIXES cccl .
  DOC "Directory holding thrust/, cub/ and cuda/ (CCCL headers); NONE = build the CPU kernels without Thrust")
if(EXISTS "${MESHDDP_THRUST_INCLUDE_DIR}/thrust/version.h")
  set(MESHDDP_WITH_THRUST ON)
  message(STATUS "meshddp: Thrust (CCCL) headers at ${MESHDDP_THRUST_INCLUDE_DIR}: CPU kernels built with Thrust's CPP system")
else()
  set(MESHDDP_WITH_THRUST OFF)
  message(STATUS "meshddp: no Thrust headers: CPU kernels run their functors in a plain loop")
endif()

# Binaries find libtorch*.so (and, through its RUNPATH, the wheel's nvidia libraries) at run time.
set(CMAKE_BUILD_RPATH "${MESHDDP_TORCH_DIR}/lib")
