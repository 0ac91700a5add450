#include "tp/tp_layers.h"

#include "mesh/collectives.h"
#include "mesh/placement.h"
#include "tp/linear_with_grad_in_buffer.h"
#include "tp/tp_functions.h"

#include <torch/torch.h>

#include <cmath>

namespace meshddp::tp {
namespace {

bool active(Group* g) { return g != nullptr && g->getSize() > 1; }

// Keeps this rank's chunk of `param` along `dim` (in place: same TensorImpl) and records it. A
// tensor that is already this shard (a tied weight that another plan entry parallelized first, e.g.
// an LM head sharing the vocab-parallel embedding) is left as it is: one tensor is sharded once.
void shard_param(torch::Tensor& param, int64_t dim, Group& tp, const char* layer) {
  const Placement current = get_placement(param);
  if (current.is_shard()) {
    TORCH_CHECK(current.dim == dim && current.tp_size == tp.getSize() && current.group == tp.getGroupName(),
                "parallelize: a ", layer, "'s weight is already sharded as ", current.str(), " over group '",
                current.group, "' (a tensor tied to a layer that another plan entry parallelized) and cannot also be ",
                "Shard(", dim, ") over group '", tp.getGroupName(), "'; give tied layers styles that split the ",
                "shared tensor the same way (e.g. VocabParallel embedding + ColwiseParallel LM head)");
    return;
  }
  torch::NoGradGuard no_grad;
  param.set_data(local_chunk(param.detach(), dim, tp).clone());
  set_placement(param, Placement::shard(dim, tp.getSize(), tp.getRank(), tp.getGroupName()));
}

}  // namespace

LinearImpl::LinearImpl(int64_t in, int64_t out, bool with_bias) : in_features(in), out_features(out) {
  weight = register_parameter("weight", torch::empty({out, in}));
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));  // torch::nn::Linear's init
  if (with_bias) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    bias = register_parameter("bias", torch::empty({out}));
    torch::nn::init::uniform_(bias, -bound, bound);
  }
}

LinearImpl::LinearImpl(torch::Tensor shared_weight)
    : in_features(shared_weight.size(1)), out_features(shared_weight.size(0)) {
  TORCH_CHECK(shared_weight.dim() == 2, "tp::Linear: a shared weight must be 2-D [out, in], got ",
              shared_weight.sizes());
  weight = register_parameter("weight", std::move(shared_weight));
}

torch::Tensor LinearImpl::forward(const torch::Tensor& x) {
  switch (mode_) {
    case Mode::kColwise: {
      auto in = sequence_parallel_ ? gather_sequence(x, tp_) : copy_to_tp(x, tp_);
      auto y = linear_with_grad_in_buffer(in, weight, bias);
      return gather_output_ ? gather_last_dim(y, tp_) : y;
    }
    case Mode::kRowwise: {
      auto partial = linear_with_grad_in_buffer(x, weight);
      auto y = sequence_parallel_ ? reduce_scatter_sequence(partial, tp_) : reduce_from_tp(partial, tp_);
      // In y's dtype: under autocast y is in the autocast dtype, and so is F.linear's output.
      return bias.defined() ? y + bias.to(y.scalar_type()) : y;
    }
    default:
      return linear_with_grad_in_buffer(x, weight, bias);
  }
}

void LinearImpl::parallelize_colwise(Group* tp, bool sequence_parallel, bool gather_output) {
  mode_ = Mode::kColwise;
  tp_ = tp;
  sequence_parallel_ = sequence_parallel;
  gather_output_ = gather_output;
  if (!active(tp)) return;
  shard_param(weight, 0, *tp, "column-parallel Linear");
  if (bias.defined()) shard_param(bias, 0, *tp, "column-parallel Linear");
}

void LinearImpl::parallelize_rowwise(Group* tp, bool sequence_parallel) {
  mode_ = Mode::kRowwise;
  tp_ = tp;
  sequence_parallel_ = sequence_parallel;
  if (!active(tp)) return;
  shard_param(weight, 1, *tp, "row-parallel Linear");
  // The bias is added after the reduction: every rank adds the same bias. Under sequence
  // parallelism each rank adds it to its sequence chunk only, so its gradient is partial over TP.
  if (bias.defined()) {
    set_placement(bias, sequence_parallel ? Placement::partial_grad(tp->getGroupName()) : Placement::replicate());
  }
}

EmbeddingImpl::EmbeddingImpl(int64_t num, int64_t d) : num_embeddings(num), dim(d) {
  weight = register_parameter("weight", torch::empty({num, d}));
  torch::nn::init::normal_(weight, 0.0, 0.02);
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& ids) {
  if (mode_ == Mode::kVocabParallel && active(tp_)) {
    const int64_t rows = weight.size(0), start = tp_->getRank() * rows;
    auto outside = (ids < start).logical_or(ids >= start + rows);
    auto local_ids = (ids - start).masked_fill(outside, 0);
    auto partial = torch::embedding(weight, local_ids).masked_fill(outside.unsqueeze(-1), 0.0);
    return sequence_parallel_ ? reduce_scatter_sequence(partial, tp_) : reduce_from_tp(partial, tp_);
  }
  auto out = torch::embedding(weight, ids);
  return mode_ == Mode::kSequenceSharded ? scatter_sequence(out, tp_) : out;
}

torch::Tensor EmbeddingImpl::unembed(const torch::Tensor& h) {
  if (mode_ == Mode::kVocabParallel && active(tp_)) {
    auto in = sequence_parallel_ ? gather_sequence(h, tp_) : copy_to_tp(h, tp_);
    return linear_with_grad_in_buffer(in, weight);
  }
  return linear_with_grad_in_buffer(h, weight);
}

void EmbeddingImpl::parallelize_vocab(Group* tp, bool sequence_parallel) {
  mode_ = Mode::kVocabParallel;
  tp_ = tp;
  sequence_parallel_ = sequence_parallel;
  if (active(tp)) shard_param(weight, 0, *tp, "vocab-parallel Embedding");
}

void EmbeddingImpl::parallelize_sequence_sharded(Group* tp) {
  mode_ = Mode::kSequenceSharded;
  tp_ = tp;
}

LayerNormImpl::LayerNormImpl(int64_t d, double e) : dim(d), eps(e) {
  weight = register_parameter("weight", torch::ones({d}));
  bias = register_parameter("bias", torch::zeros({d}));
}

torch::Tensor LayerNormImpl::forward(const torch::Tensor& x) { return torch::layer_norm(x, {dim}, weight, bias, eps); }

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Megatron's vocab-parallel cross-entropy: per-token loss = log(sum_v exp(z_v - m)) - (z_t - m).
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits, const torch::Tensor& targets,
                               Group* g) {
    const int64_t vocab_local = logits.size(1), start = g->getRank() * vocab_local;
    auto max = std::get<0>(logits.detach().max(1));
    all_reduce_max_now(*g, max, "the max logit of a vocab-parallel cross-entropy");
    auto shifted = logits.detach() - max.unsqueeze(1);
    auto exp = shifted.exp();
    auto sum_exp = exp.sum(1);
    all_reduce_sum_now(*g, sum_exp, "the softmax sum of a vocab-parallel cross-entropy");
    auto outside = (targets < start).logical_or(targets >= start + vocab_local);
    auto local_t = (targets - start).masked_fill(outside, 0);
    auto target_logit = shifted.gather(1, local_t.unsqueeze(1)).squeeze(1).masked_fill(outside, 0.0).contiguous();
    all_reduce_sum_now(*g, target_logit, "the target logit of a vocab-parallel cross-entropy");
    ctx->save_for_backward({exp / sum_exp.unsqueeze(1), local_t, outside});
    return sum_exp.log() - target_logit;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto grad = saved[0].clone();  // softmax over the full vocab, this rank's columns
    auto hit = saved[2].logical_not().to(grad.scalar_type());
    grad.scatter_add_(1, saved[1].unsqueeze(1), -hit.unsqueeze(1));
    return {grad * grads[0].unsqueeze(1), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets, Group* vocab_group) {
  if (!active(vocab_group)) return torch::nn::functional::cross_entropy(logits, targets);
  return VocabParallelCrossEntropy::apply(logits, targets, vocab_group).mean();
}

}  // namespace meshddp::tp
