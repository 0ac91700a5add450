#include "tp/tp_functions.h"

#include "mesh/collectives.h"

#include <torch/autograd.h>
#include <torch/torch.h>

namespace meshddp::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool trivial(Group* g) { return g == nullptr || g->getSize() == 1; }
void save_group(AutogradContext* ctx, Group* g) { ctx->saved_data["group"] = reinterpret_cast<int64_t>(g); }
Group& saved_group(AutogradContext* ctx) { return *reinterpret_cast<Group*>(ctx->saved_data["group"].toInt()); }

at::Tensor all_reduced(const at::Tensor& x, Group& g) {
  at::Tensor out = x.contiguous().clone();
  all_reduce_sum_now(g, out, "a tensor-parallel all-reduce");
  return out;
}

// Note [Double backward through the TP regions]
//   Each region's backward is its conjugate region, applied as a Function: under no-grad (a plain
//   backward) that is the same collective, and with create_graph it is recorded with its own
//   backward, so a gradient penalty's second-order gradient crosses the TP ranks as the first-order
//   one does. A bare c10d collective has no autograd kernel and would cut that path; a bare
//   identity (reduce_from_tp's backward) would leave each rank with only its own share of the
//   gradient of a replicated tensor. The pairs (forward / backward):
//     copy_to_tp      identity / all-reduce      <->  reduce_from_tp   all-reduce / identity
//     gather (dim d)  all-gather / local chunk   <->  scatter (dim d)  local chunk / all-gather
//     gather_sequence all-gather / reduce-scatter <-> reduce_scatter_sequence  reduce-scatter / all-gather
struct CopyToTp : torch::autograd::Function<CopyToTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Group* g) {
    save_group(ctx, g);
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads);
};

struct ReduceFromTp : torch::autograd::Function<ReduceFromTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Group* g) {
    save_group(ctx, g);
    return all_reduced(x, *g);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {CopyToTp::apply(grads[0], &saved_group(ctx)), at::Tensor()};
  }
};

variable_list CopyToTp::backward(AutogradContext* ctx, variable_list grads) {
  return {ReduceFromTp::apply(grads[0], &saved_group(ctx)), at::Tensor()};
}

struct GatherDim : torch::autograd::Function<GatherDim> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, Group* g) {
    save_group(ctx, g);
    ctx->saved_data["dim"] = dim;
    return all_gather_dim(x, dim, *g);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads);
};

struct ScatterDim : torch::autograd::Function<ScatterDim> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, Group* g) {
    save_group(ctx, g);
    ctx->saved_data["dim"] = dim;
    return local_chunk(x, dim, *g).contiguous();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {GatherDim::apply(grads[0], ctx->saved_data["dim"].toInt(), &saved_group(ctx)), at::Tensor(), at::Tensor()};
  }
};

variable_list GatherDim::backward(AutogradContext* ctx, variable_list grads) {
  return {ScatterDim::apply(grads[0], ctx->saved_data["dim"].toInt(), &saved_group(ctx)), at::Tensor(), at::Tensor()};
}

struct GatherSequence : torch::autograd::Function<GatherSequence> {  // backward reduce-scatters
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Group* g) {
    save_group(ctx, g);
    return all_gather_dim(x, 1, *g);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads);
};

struct ReduceScatterSequence : torch::autograd::Function<ReduceScatterSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Group* g) {
    save_group(ctx, g);
    return reduce_scatter_dim(x, 1, *g);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {GatherSequence::apply(grads[0], &saved_group(ctx)), at::Tensor()};
  }
};

variable_list GatherSequence::backward(AutogradContext* ctx, variable_list grads) {
  return {ReduceScatterSequence::apply(grads[0], &saved_group(ctx)), at::Tensor()};
}

}  // namespace

at::Tensor all_gather_dim(const at::Tensor& x, int64_t dim, Group& group) {
  const int64_t n = group.getSize();
  at::Tensor flat = x.contiguous().view({-1});
  at::Tensor out = at::empty({n * flat.numel()}, flat.options());
  wait_collective(all_gather_into(group, out, flat, "a tensor-parallel all-gather"), group,
                  "a tensor-parallel all-gather");
  std::vector<int64_t> shape{n};
  shape.insert(shape.end(), x.sizes().begin(), x.sizes().end());
  return at::cat(out.view(shape).unbind(0), dim);
}

at::Tensor reduce_scatter_dim(const at::Tensor& x, int64_t dim, Group& group) {
  const int64_t n = group.getSize();
  TORCH_CHECK(x.size(dim) % n == 0, "tensor parallel: dim ", dim, " of size ", x.size(dim),
              " does not divide by the TP size ", n, "; make the sequence length a multiple of TP");
  at::Tensor stacked = at::stack(x.chunk(n, dim), 0).contiguous();  // [n, ...chunk...]
  at::Tensor out = at::empty(stacked.sizes().slice(1), x.options());
  wait_collective(reduce_scatter_sum(group, out.view({-1}), stacked.view({-1}), "a tensor-parallel reduce-scatter"),
                  group, "a tensor-parallel reduce-scatter");
  return out;
}

at::Tensor local_chunk(const at::Tensor& x, int64_t dim, Group& group) {
  const int64_t n = group.getSize();
  TORCH_CHECK(x.size(dim) % n == 0, "tensor parallel: dim ", dim, " of size ", x.size(dim),
              " does not divide by the TP size ", n);
  return x.chunk(n, dim)[group.getRank()];
}

at::Tensor copy_to_tp(const at::Tensor& x, Group* g) { return trivial(g) ? x : CopyToTp::apply(x, g); }
at::Tensor reduce_from_tp(const at::Tensor& x, Group* g) { return trivial(g) ? x : ReduceFromTp::apply(x, g); }
at::Tensor gather_last_dim(const at::Tensor& x, Group* g) {
  return trivial(g) ? x : GatherDim::apply(x, x.dim() - 1, g);
}
at::Tensor gather_sequence(const at::Tensor& x, Group* g) { return trivial(g) ? x : GatherSequence::apply(x, g); }
at::Tensor reduce_scatter_sequence(const at::Tensor& x, Group* g) {
  return trivial(g) ? x : ReduceScatterSequence::apply(x, g);
}
at::Tensor scatter_sequence(const at::Tensor& x, Group* g) { return trivial(g) ? x : ScatterDim::apply(x, 1, g); }

}  // namespace meshddp::tp
