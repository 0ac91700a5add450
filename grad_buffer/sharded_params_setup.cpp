// GradBuffer's construction under the "optim_grads_params" sharding strategy (ZeRO-3): the FSDP units
// of its params and the refusal of what the strategy does not support yet. Part of GradBuffer
// (grad_buffer.h); the sharded params themselves are ShardedParams' (Note [Sharded parameters]).
#include "grad_buffer/grad_buffer.h"

#include <c10/util/Exception.h>

namespace meshddp {

FsdpUnits GradBuffer::fsdp_units() const {
  std::vector<std::string> names;
  names.reserve(params_.size());
  for (const NamedParam& p : params_) names.push_back(p.name);
  return assign_fsdp_units(names, config_.fsdp_unit_modules);
}

void GradBuffer::check_shardable_param(const NamedParam& p, bool expert) const {
  const auto refuse = [&](const char* what, const char* instead) {
    TORCH_CHECK(false, "GradBuffer: data_parallel_sharding_strategy '", kShardOptimGradsParams, "' does not support ",
                what, " yet (parameter ", describe_param_name(p), "); ", instead);
  };
  if (expert) refuse("expert (MoE) params", "use 'optim_grads' (gradients and optimizer state sharded)");
  if (config_.num_distributed_optimizer_instances != 1) {
    refuse("num_distributed_optimizer_instances > 1", "use 'optim_grads' for hierarchical instances");
  }
}

}  // namespace meshddp
