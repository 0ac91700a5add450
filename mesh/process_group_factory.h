// Makes one c10d ProcessGroup over a store: Gloo for CPU tensors on every group, and for CUDA
// tensors NCCL on a CUDA mesh, Gloo on a CPU mesh; and gives a group made elsewhere (torch's
// init_process_group("nccl")) the CPU backend meshddp's control plane needs. The only place that
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
c10::intrusive_ptr<c10d::ProcessGroup> make_process_group(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                          int size, c10::DeviceType device_type,
                                                          std::chrono::milliseconds timeout, const std::string& name,
                                                          const NcclSetup& nccl = {});

// Note [Control plane on any group]
// meshddp's own agreement collectives (the settings and model checks, the TP verdict, checkpoint
// agreement, the non-finite report, MESHDDP_DEBUG_SYNC) are a few bytes each and use CPU tensors.
// Groups meshddp makes have a Gloo backend for CPU tensors; a group a user hands in may not
// (torch's init_process_group("nccl") and new_group(backend="nccl") register NCCL for CUDA only),
// and every one of those collectives would fail with "No backend type associated with device type
// cpu". ensure_cpu_backend gives such a group a Gloo backend for CPU tensors, made from the group's
// own store (a prefix of its own), as torch's "cpu:gloo,cuda:nccl" would have, and as Megatron keeps
// Gloo side groups. Chosen over the group's device (what PyTorch DDP does) because the control plane
// then needs no device copies or stream syncs, and because it runs and is tested on CPU machines;
// chosen over the bare store because a store all-gather costs N^2 requests on one server. Its cost:
// one Gloo context (a TCP connection per peer) per such group, made once.

// If `group` has no backend for CPU tensors, registers a Gloo backend for them (Note [Control plane
// on any group]); a no-op otherwise. Collective over `group` when it does register one: every member
// must call it at the same point (meshddp does, in DeviceMesh::from_groups and at DDP and GradBuffer
// construction). A Gloo backend the group already has for CUDA tensors ("cuda:gloo") is reused;
// otherwise the new one takes the group's timeout. Throws naming `what` when the group has no store
// to rendezvous through.
void ensure_cpu_backend(c10d::ProcessGroup& group, const std::string& what);

}  // namespace meshddp
