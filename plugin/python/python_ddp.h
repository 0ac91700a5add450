// PythonDdp: DistributedDataParallel for a Python torch.nn.Module, the engine under meshddp's Python
// package. Python hands over named tensors and c10d process groups once; every step (hooks, bucket
// collectives, waits) then runs in C++ exactly as for a LibTorch module. Knows nothing of pybind11:
// the bindings are in meshddp_module.cpp.
//
// Note [DTensor parameters]
//   A parameter that torch's parallelize_module turned into a DTensor is an autograd leaf whose
//   data is a plain local tensor (this TP rank's shard). The GradBuffer is given the local tensor
//   (layout, buckets and DP collectives cover local shards only), with requires_grad set so it is
//   trainable; its .grad is its slot in the buffer, as for any param. The DTensor's own .grad is a
//   DTensor wrapping that same slot with the param's placements (made once by the Python side), so
//   autograd's AccumulateGrad adds each new DTensor gradient into the slot in place, through
//   DTensor, which first redistributes a Partial gradient to the param's placement: the TP
//   reduction is DTensor's, done once, and meshddp never reduces over TP again. A post-hook on the
//   DTensor's AccumulateGrad node (C++, no Python) then reports the local param ready to the
//   GradBuffer, which launches its bucket over DP. zero_grad_buffer() puts the DTensor grads back
//   if something (torch's optimizer.zero_grad()) replaced them.
//   Under optim_grads (ZeRO-2) there is no whole buffer for the DTensor .grad to wrap: .grad starts
//   None, AccumulateGrad stores the new DTensor gradient, and a Python post-accumulate-grad hook on the
//   DTensor (meshddp/_grad_shards.py, run by torch before the node's post-hooks) moves it, at the
//   param's placements, onto the local tensor's .grad and sets the DTensor's .grad back to None; the
//   post-hook then reports the local param, whose gradient the GradBuffer adds into its bucket's block.
#pragma once

#include "grad_buffer/param_gather.h"
#include "grad_buffer/sharded_params.h"
#include "plugin/distributed_data_parallel.h"

#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace torch::autograd {
struct Node;
}

namespace meshddp {

// A DTensor param: its name, the DTensor leaf (autograd's view of it), its local tensor (what the
// GradBuffer holds: it must be among the params given to PythonDdp under the same name), and the
// DTensor .grad wrapping the local slot (see the Note). `shard_dim` is the tensor dim the param is
// sharded on over TP, -1 for Replicate.
struct DtensorParam {
  std::string name;
  at::Tensor leaf;
  at::Tensor local;
  int64_t shard_dim = -1;
};

class PythonDdp : public DdpEngine {
 public:
  // `params`: every parameter (DTensor params by their local tensor), deduplicated, registration
  // order; `buffers`: the module's buffers (local tensors likewise). Collective over the DP group.
  // `data_parallel_group`: as DdpEngine's (the whole DP group under hierarchical ZeRO-1).
  PythonDdp(std::vector<NamedTensor> params, std::vector<NamedTensor> buffers, std::vector<DtensorParam> dtensors,
            SyncGroups groups, const std::vector<int64_t>& dp_global_ranks, DdpConfig config,
            c10::intrusive_ptr<c10d::ProcessGroup> data_parallel_group = {});
  ~PythonDdp();
  PythonDdp(const PythonDdp&) = delete;
  PythonDdp& operator=(const PythonDdp&) = delete;

  // The DTensor grads (same order as `dtensors`), each a DTensor over its param's local slot
  // (main_grad(name)). Assigned to the leaves' .grad now and after every zero_grad_buffer().
  void set_dtensor_grads(std::vector<at::Tensor> grads);
  // Zeroes the buffers and points every param's .grad (DTensor ones included) back at its slot.
  void zero_grad_buffer();
  // DdpEngine's, after checking no DTensor param was frozen since construction (the GradBuffer
  // checks the local tensors it holds; a DTensor leaf's requires_grad is its own).
  void finish_grad_sync();

  // Around the Python module's forward: the check that the previous step's sync has finished, the
  // scope the forward runs in, and, with find_unused_parameters, marking the params the outputs
  // cannot reach. The scope is DdpEngine's ParamWaitScope, as in the C++ forward: the wait for
  // pending param all-gathers (distributed optimizer with overlap), or under "optim_grads_params" the
  // ShardedParams UseScope (each unit gathered on use, released after; Note [Sharded parameters]).
  class ForwardScope {
   public:
    explicit ForwardScope(const PythonDdp& ddp) : scope_(ddp.param_wait_scope()) {}

   private:
    ParamWaitScope scope_;
  };
  void check_before_forward() { before_forward(); }
  std::unique_ptr<ForwardScope> open_forward_scope() const { return std::make_unique<ForwardScope>(*this); }
  void mark_unused(const std::vector<at::Tensor>& outputs) const { after_forward(outputs); }

  // -- "optim_grads_params" (ZeRO-3) from Python; every one throws under the other strategies --
  // Turns the gather-on-use interception on for the calling thread (the constructing one), so that
  // an op there that reads a released unit before the first forward is refused naming the param,
  // not run on storage without bytes.
  void intercept_param_reads_in_this_thread();
  // Gathers every unit and keeps it until release_all_params() (to read every whole param at once:
  // the Python state_dict()). Collective over DP: every rank calls both.
  void gather_all_params();
  void release_all_params();
  // This rank's pieces of the params: (param name, first element in the flattened param, a view of
  // the shard that holds them), for a load that writes whole values into the shards.
  std::vector<std::tuple<std::string, int64_t, at::Tensor>> param_shard_pieces() const;
  // Bytes of param storage this rank holds now, the most since construction or
  // reset_peak_param_storage(), and the shards alone (ShardedParams::resident_bytes etc.).
  int64_t param_storage_bytes() const;
  int64_t peak_param_storage_bytes() const;
  void reset_peak_param_storage();
  int64_t param_shard_bytes() const;
  // A compiled section of the wrapped module (torch.compile(ddp), split at the buckets: Note [Compiled sections
  // under optim_grads_params], meshddp/_compiled_sections.py), whose kernels read params without the op
  // interception. Opened just before the section's forward runs, inside the wrapper's forward: the units its
  // `inputs` live in are gathered and waited for, and kept until the scope ends, just after the section ran
  // (the ops the interception still sees, such as extern kernels, share its OpScope). params(): those inputs,
  // for gather_for_compiled_backward() just before the section's backward (which reads what it saved).
  class CompiledSectionScope {
   public:
    CompiledSectionScope(ShardedParams& sharded, const std::vector<at::Tensor>& inputs);
    const std::vector<at::Tensor>& params() const { return params_; }

   private:
    ShardedParams::OpScope op_;  // before params_: the units are used inside it
    std::vector<at::Tensor> params_;
  };
  std::unique_ptr<CompiledSectionScope> open_compiled_section(const std::vector<at::Tensor>& inputs) const;
  void gather_for_compiled_backward(const std::vector<at::Tensor>& params) const;
  // The FSDP units (DdpConfig::fsdp_unit_modules over the params' module paths), in the order of their
  // first param: what the units are made of, by name.
  std::vector<std::string> fsdp_unit_names() const;

  // Names of the trainable params in GradBuffer (bucket) order, after deduplication.
  std::vector<std::string> param_names() const;

 private:
  struct Relay;
  std::vector<DtensorParam> dtensors_;
  std::vector<at::Tensor> dtensor_grads_;
  std::vector<std::unique_ptr<Relay>> relays_;

  void check_dtensors_still_trainable(const char* who) const;
};

}  // namespace meshddp
