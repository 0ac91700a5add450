# Precompiled torch headers. Parsing torch's headers is most of what compiling one of our sources
# costs (g++ 12, -O2 -g1: 22 of 28 s for grad_buffer.cpp), so targets that share compile flags share
# one precompiled header (docs/reference/building.md "Build time"). Two groups, because a precompiled header is
# only valid with the flags it was made with (-fPIC vs the default -fPIE):
#   engine: the position-independent libraries (mesh, grad_buffer, optimizer, plugin), which also go
#           into the Python module; ATen, autograd and c10d's ProcessGroup;
#   app:    examples, benchmarks and tests (default flags); torch/torch.h as well.
# -DMESHDDP_PRECOMPILED_HEADERS=OFF compiles every file on its own (e.g. to check its includes).
option(MESHDDP_PRECOMPILED_HEADERS "Precompile torch's headers, one per group of targets" ON)

set(_meshddp_engine_pch
  <ATen/ATen.h>
  <torch/csrc/autograd/function.h>
  <torch/csrc/autograd/variable.h>
  <torch/csrc/distributed/c10d/ProcessGroup.hpp>)
set(_meshddp_app_pch ${_meshddp_engine_pch} <torch/torch.h>)

# meshddp_precompile_headers(<engine|app> <owner> [<target>...]): <owner> builds the group's header,
# the other targets reuse it. C++ sources only (the .cu files are torch-free).
function(meshddp_precompile_headers group owner)
  if(NOT MESHDDP_PRECOMPILED_HEADERS)
    return()
  endif()
  set(_headers "")
  foreach(_h IN LISTS _meshddp_${group}_pch)
    list(APPEND _headers "$<$<COMPILE_LANGUAGE:CXX>:${_h}>")
  endforeach()
  target_precompile_headers(${owner} PRIVATE ${_headers})
  foreach(_target IN LISTS ARGN)
    target_precompile_headers(${_target} REUSE_FROM ${owner})
  endforeach()
endfunction()

# meshddp_app_targets(<target>...): these targets join the app group (set up once all are defined).
function(meshddp_app_targets)
  set_property(GLOBAL APPEND PROPERTY MESHDDP_APP_TARGETS ${ARGN})
endfunction()
