// Makes one c10d ProcessGroup over a store: Gloo for CPU tensors on every group, and for CUDA
// tensors NCCL on a CUDA mesh, Gloo on a CPU mesh. The only place that
// constructs backends; the Gloo and NCCL headers stay out of every other file.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

namespace meshddp {

// NCCL communicator set-up of a CUDA group (Note [NCCL communicator set-up] in device_mesh.cpp).
struct NcclSetup {
  int device_index = -1;  // >= 0: bind the group to cuda:<index> and create its communicator now
  // Set: make the communicator by ncclCommSplit of this group's (already created) communicator, with
  // `split_color` (the same on every member of the new group, different across groups). Every rank
  // of `split_parent` must then create its groups in the same order (a split is collective over the
  // parent). Null: bootstrap through the store (ncclCommInitRank).
  c10::intrusive_ptr<c10d::ProcessGroup> split_parent;
  int split_color = 0;
};

// Blocks until all `size` members have called it with the same store (each with its own rank).
// `name` becomes the group's name (shown in c10d's errors, and the NCCL watchdog's). kCUDA needs a
// build with CUDA; `nccl` applies to kCUDA only.
c10::intrusive_ptr<c10d::ProcessGroup> make_process_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                          int rank, int size, c10::DeviceType device_type,
                                                          std::chrono::milliseconds timeout,
                                                          const std::string& name, const NcclSetup& nccl = {});

}  // namespace meshddp
