# Finds nlohmann-json (header-only JSON for C++) in the PyPI package nlohmann-json==3.12.0 that
# scripts/setup.sh installs into .venv beside torch, and defines meshddp::json (what checkpoint/
# links). The package ships the headers (nlohmann_json/include/nlohmann/...) but no CMake config, so
# the include directory is asked of the venv's Python, as for torch; MESHDDP_JSON_INCLUDE_DIR names
# another copy of the same version instead. Why this package: docs/reference/building.md "nlohmann-json".
set(MESHDDP_JSON_VERSION "3.12.0")
if(NOT MESHDDP_JSON_INCLUDE_DIR)
  execute_process(
    # find_spec, not import: the package's __init__ needs importlib_resources, which an offline
    # install (scripts/gpu_check.sh) leaves out; only the headers are wanted.
    COMMAND "${MESHDDP_PYTHON}" -c "import importlib.util, os; print(os.path.join(importlib.util.find_spec('nlohmann_json').submodule_search_locations[0], 'include'))"
    OUTPUT_VARIABLE _json_include OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _json_rc ERROR_QUIET)
  if(NOT _json_rc EQUAL 0)
    message(FATAL_ERROR "meshddp: '${MESHDDP_PYTHON}' finds no package nlohmann_json: the PyPI package "
                        "nlohmann-json==${MESHDDP_JSON_VERSION} is missing. Run scripts/setup.sh (it installs it), or "
                        "pass -DMESHDDP_JSON_INCLUDE_DIR=<a directory holding nlohmann/json.hpp ${MESHDDP_JSON_VERSION}>.")
  endif()
  set(MESHDDP_JSON_INCLUDE_DIR "${_json_include}" CACHE PATH "Directory holding nlohmann/json.hpp (nlohmann-json ${MESHDDP_JSON_VERSION})")
endif()
set(_json_macros "${MESHDDP_JSON_INCLUDE_DIR}/nlohmann/detail/abi_macros.hpp")
if(NOT EXISTS "${_json_macros}")
  message(FATAL_ERROR "meshddp: no nlohmann-json headers under MESHDDP_JSON_INCLUDE_DIR='${MESHDDP_JSON_INCLUDE_DIR}' "
                      "(no nlohmann/detail/abi_macros.hpp); run scripts/setup.sh")
endif()
file(STRINGS "${_json_macros}" _json_version_lines REGEX "#define NLOHMANN_JSON_VERSION_(MAJOR|MINOR|PATCH) ")
set(_json_found_version "")
foreach(_line IN LISTS _json_version_lines)
  string(REGEX REPLACE ".*_VERSION_[A-Z]+ +([0-9]+).*" "\\1" _part "${_line}")
  list(APPEND _json_found_version "${_part}")
endforeach()
list(JOIN _json_found_version "." _json_found_version)
if(NOT _json_found_version STREQUAL MESHDDP_JSON_VERSION)
  message(FATAL_ERROR "meshddp: nlohmann-json ${_json_found_version} at '${MESHDDP_JSON_INCLUDE_DIR}'; this build is "
                      "pinned to ${MESHDDP_JSON_VERSION} (scripts/setup.sh installs it)")
endif()
message(STATUS "meshddp: nlohmann-json ${_json_found_version} at ${MESHDDP_JSON_INCLUDE_DIR}")
add_library(meshddp_json INTERFACE)
add_library(meshddp::json ALIAS meshddp_json)
# Build tree only; the installed package carries its own copy of the headers (cmake/Install.cmake).
target_include_directories(meshddp_json SYSTEM INTERFACE "$<BUILD_INTERFACE:${MESHDDP_JSON_INCLUDE_DIR}>")
# No implicit `std::string s = json;`: every read says the type it expects (checkpoint/json.h).
target_compile_definitions(meshddp_json INTERFACE JSON_USE_IMPLICIT_CONVERSIONS=0)
