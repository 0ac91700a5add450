# The C++ package: `cmake --install build --prefix P` installs the public headers under
# P/include/meshddp/ (the front end that <meshddp/meshddp.h> reaches, source folders kept:
# <meshddp/mesh/device_mesh.h>, ...; the umbrella <meshddp/meshddp.h>; only
# P/include is on a consumer's include path, and the headers include each other by relative path
# ("../checkpoint/store.h"), so a consumer's own folders named mesh/, checkpoint/, ... cannot
# shadow them), the
# static libraries under P/lib, and P/lib/cmake/meshddp/ with meshddpConfig.cmake + its version file,
# exporting meshddp::meshddp (docs/reference/building.md "Using meshddp from another CMake project"). The
# engine is built position-independent, so the archives link into executables and shared objects.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(_meshddp_libs meshddp_mesh meshddp_checkpoint meshddp_grad_buffer meshddp_common meshddp_tp meshddp_optimizer meshddp_plugin)
set_target_properties(${_meshddp_libs} PROPERTIES POSITION_INDEPENDENT_CODE ON)
foreach(_lib IN LISTS _meshddp_libs)
  string(REPLACE "meshddp_" "" _short "${_lib}")
  set_target_properties(${_lib} PROPERTIES EXPORT_NAME ${_short})
endforeach()
set_target_properties(meshddp_torch PROPERTIES EXPORT_NAME torch)
set_target_properties(meshddp_json PROPERTIES EXPORT_NAME json)

# The headers are C++20: a consumer linking any meshddp target gets at least that.
target_compile_features(meshddp_torch INTERFACE cxx_std_20)

# meshddp::meshddp: the whole public API in one target (what a consumer links).
add_library(meshddp_meshddp INTERFACE)
add_library(meshddp::meshddp ALIAS meshddp_meshddp)
set_target_properties(meshddp_meshddp PROPERTIES EXPORT_NAME meshddp)
target_link_libraries(meshddp_meshddp INTERFACE meshddp::plugin)
target_include_directories(meshddp_meshddp INTERFACE "$<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include;${PROJECT_BINARY_DIR}/include>")

# <meshddp/version.h>: the package's version and the torch it was built against.
configure_file("${PROJECT_SOURCE_DIR}/cmake/version.h.in" "${PROJECT_BINARY_DIR}/include/meshddp/version.h" @ONLY)

install(TARGETS meshddp_torch meshddp_json ${_meshddp_libs} meshddp_meshddp EXPORT meshddpTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
# The public headers: exactly those <meshddp/meshddp.h> reaches (tests/build/check_public_headers.py
# compares this list with the compiler's and builds a consumer against the installed ones). Every
# other header is internal and is not installed.
set(MESHDDP_PUBLIC_HEADERS
  checkpoint/checkpoint_values.h
  checkpoint/save_options.h
  common/grad_norm.h
  grad_buffer/grad_buffer_config.h
  grad_buffer/grad_buffer_handle.h
  grad_buffer/named_param.h
  grad_buffer/sync_groups.h
  mesh/device_mesh.h
  optimizer/distributed_optimizer.h
  optimizer/lr_scheduler.h
  optimizer/muon.h
  optimizer/shard_layout.h
  plugin/checkpoint_saver.h
  plugin/distributed_data_parallel.h
  plugin/pipeline.h
  plugin/training_checkpoint.h
  tp/parallelize.h
  tp/tp_layers.h)
foreach(_header IN LISTS MESHDDP_PUBLIC_HEADERS)
  get_filename_component(_dir "${_header}" DIRECTORY)
  install(FILES "${PROJECT_SOURCE_DIR}/${_header}" DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/meshddp/${_dir})
endforeach()
install(FILES "${PROJECT_SOURCE_DIR}/include/meshddp/meshddp.h" "${PROJECT_BINARY_DIR}/include/meshddp/version.h"
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/meshddp)
install(DIRECTORY "${PROJECT_SOURCE_DIR}/third_party/gloo/include/"
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/meshddp/third_party/gloo)
# nlohmann-json (MIT; the checkpoint manifest's header includes it): the pinned headers go with the
# package, so a consumer needs neither the venv nor its own copy.
install(DIRECTORY "${MESHDDP_JSON_INCLUDE_DIR}/nlohmann" DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/meshddp/third_party/json)
install(EXPORT meshddpTargets NAMESPACE meshddp:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/meshddp)

# The installed meshddp::torch is given its interface by the config, from the consumer's own torch
# (found through its CMAKE_PREFIX_PATH): the package records the torch version and the compile
# definitions this build used, no path of this machine, so the prefix can move to another one.
set(MESHDDP_INSTALL_INCLUDEDIR "${CMAKE_INSTALL_INCLUDEDIR}")  # relative or absolute (PATH_VARS handles both)
configure_package_config_file("${PROJECT_SOURCE_DIR}/cmake/meshddpConfig.cmake.in"
                              "${PROJECT_BINARY_DIR}/meshddpConfig.cmake"
                              INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/meshddp
                              PATH_VARS MESHDDP_INSTALL_INCLUDEDIR)
write_basic_package_version_file("${PROJECT_BINARY_DIR}/meshddpConfigVersion.cmake"
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES "${PROJECT_BINARY_DIR}/meshddpConfig.cmake" "${PROJECT_BINARY_DIR}/meshddpConfigVersion.cmake"
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/meshddp)
