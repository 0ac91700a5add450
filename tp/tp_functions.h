// The autograd-aware collectives of tensor parallelism (Megatron's "regions"), each with the
// backward its forward needs. All are no-ops on a TP group of size 1 (or a null group).
//
//   copy_to_tp            forward: identity              backward: all-reduce (sum)
//   reduce_from_tp        forward: all-reduce (sum)      backward: identity
//   gather_last_dim       forward: all-gather, concat    backward: keep this rank's chunk
//   gather_sequence       forward: all-gather along dim 1 (sequence)   backward: reduce-scatter
//   reduce_scatter_seq    forward: reduce-scatter along dim 1          backward: all-gather
//   scatter_sequence      forward: keep this rank's chunk of dim 1     backward: all-gather
// Collectives are synchronous (they sit on the compute path). Sequence dims must divide by TP.
// Each backward is its conjugate region, so double backward (create_graph) crosses TP too (Note
// [Double backward through the TP regions] in the .cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace meshddp::tp {

using Group = c10d::ProcessGroup;

at::Tensor copy_to_tp(const at::Tensor& x, Group* group);
at::Tensor reduce_from_tp(const at::Tensor& x, Group* group);
at::Tensor gather_last_dim(const at::Tensor& x, Group* group);
at::Tensor gather_sequence(const at::Tensor& x, Group* group);
at::Tensor reduce_scatter_sequence(const at::Tensor& x, Group* group);
at::Tensor scatter_sequence(const at::Tensor& x, Group* group);

// Plain (non-autograd) helpers, also used by the layers: all-gather `x` along `dim`, and this
// rank's chunk of `x` along `dim`.
at::Tensor all_gather_dim(const at::Tensor& x, int64_t dim, Group& group);
at::Tensor reduce_scatter_dim(const at::Tensor& x, int64_t dim, Group& group);
at::Tensor local_chunk(const at::Tensor& x, int64_t dim, Group& group);

}  // namespace meshddp::tp
