// Seeing through a tensor subclass (torch's DTensor) in the param dispatch mode (param_gather.cpp).
//
// Note [Tensor subclasses under the param modes]
//   The mode's key sits above the Python key, and torch runs a subclass's __torch_dispatch__ with every key
//   above Python excluded: the ops a DTensor runs on its local tensor never reach the mode. The mode sees only
//   the DTensor ops themselves, whose arguments are wrappers without storage of their own. So the fallback
//   asks, for each argument with the Python key, for the tensor that holds its values (a DTensor's
//   `_local_tensor`) and treats it as the argument: the op waits for (ZeRO-1) or gathers (ZeRO-3) the bucket
//   of the local tensor before the subclass's dispatch reads it, in forward, in backward (the saved DTensor
//   views share the param's storage) and between steps (refused by name, as for a plain param). The lookup
//   needs Python, so the Python extension installs it; without it (C++ only) a subclass is left as it is.
#pragma once

#include <ATen/core/Tensor.h>

namespace meshddp {

// Returns the tensor holding `t`'s values, or an undefined tensor when `t` has none to offer. Must not throw.
using TensorValuesOf = at::Tensor (*)(const at::Tensor& t);

// Installs the lookup for tensors with the Python dispatch key (once, by the Python extension).
void set_tensor_subclass_values(TensorValuesOf lookup);

}  // namespace meshddp
