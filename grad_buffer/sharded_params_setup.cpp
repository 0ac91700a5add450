// GradBuffer's construction under the "optim_grads_params" sharding strategy (ZeRO-3): the FSDP units
// of its params. Part of GradBuffer
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

}  // namespace meshddp
