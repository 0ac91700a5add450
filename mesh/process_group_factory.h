// Makes one c10d ProcessGroup over a store: Gloo for CPU tensors on every group, and for CUDA
// tensors NCCL on a CUDA mesh, Gloo on a CPU mesh. The only place that
// constructs backends; the Gloo and NCCL headers stay out of every other file.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

namespace meshddp {

// Blocks until all `size` members have called it with the same store (each with its own rank).
// `name` becomes the group's name (shown in c10d's errors). kCUDA needs a build with CUDA.
c10::intrusive_ptr<c10d::ProcessGroup> make_process_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                          int rank, int size, c10::DeviceType device_type,
                                                          std::chrono::milliseconds timeout,
                                                          const std::string& name);

}  // namespace meshddp
