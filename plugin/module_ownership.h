// Which group each of a module's tensors belongs to, and which live DDP owns it. Two questions DDP
// asks of a module at construction, before any collective:
//  - a buffer follows the reduction group of the module that owns it (expert buffers, e.g. a norm's
//    running statistics inside an expert, are broadcast and checkpointed within the expert-data-
//    parallel group, not over DP, whose ranks hold other experts);
//  - a param belongs to at most one live DDP engine: a second wrapper over the same param would add
//    its reduction on top of the first (every gradient 2x).
// Pure host logic: no communication.
#pragma once

#include "../grad_buffer/named_param.h"  // NamedTensor

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace meshddp {

// Note [Buffers follow the module that owns them]
// A buffer is an expert buffer when it was declared one (declare_expert_param works on any tensor),
// or when the nearest module enclosing it that holds params (its owner, or the closest ancestor with
// params) holds expert params only: "experts.2.norm.running_mean" (owner experts.2.norm, whose
// weight is an expert param) and "experts.2.scale" (owner experts.2, all expert params) are expert
// buffers; "moe.bias" (owner moe, holding the dense router and the experts) and a top-level buffer
// are dense. Modules are found by the dotted names: `params` are every param (frozen too) by module
// path, `buffers` likewise.
// Returns, per buffer, whether it is an expert buffer.
std::vector<bool> expert_buffer_flags(const std::vector<NamedTensor>& params, const std::vector<NamedTensor>& buffers);

// Claims `params` (every param of a module, by name) for one live DDP engine until destroyed or
// released. Refuses, before claiming any, a param another live claim holds, naming it, the name the
// other wrapper knows it by, and the way out. Thread-safe (ranks as threads claim their own params).
class ParamClaim {
 public:
  ParamClaim() = default;
  explicit ParamClaim(const std::vector<NamedTensor>& params);
  ~ParamClaim() { release(); }
  ParamClaim(ParamClaim&& other) noexcept;
  ParamClaim& operator=(ParamClaim&& other) noexcept;
  ParamClaim(const ParamClaim&) = delete;
  ParamClaim& operator=(const ParamClaim&) = delete;
  void release();

 private:
  std::vector<const void*> claimed_;  // TensorImpl addresses, valid while the params live
};

}  // namespace meshddp
