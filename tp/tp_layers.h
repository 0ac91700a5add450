// Layers a model is written with, which behave exactly like torch's Linear / Embedding / LayerNorm
// until a parallelize plan (tp/parallelize.h) turns them, in place, into Megatron-style
// tensor-parallel layers over the mesh's TP dim. So model code holds no parallelism: the same
// module runs in one process (the golden) and, after parallelize(), on a DP x TP mesh.
//
// Why layers of our own: LibTorch C++ modules have no forward hooks, and a parent calls its typed
// children directly (fc1(x) on a torch::nn::Linear), so a plan cannot swap or wrap torch's layers.
// These keep torch's initialisation and math; parallelizing shards their parameters in place
// (same TensorImpl, so optimizers and DDP see the local shard) and records each one's Placement.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <string>

namespace meshddp::tp {

using Group = c10d::ProcessGroup;  // as in tp/tp_functions.h (the TP collectives these layers run)

// y = x W^T + b. Column-parallel: W's rows (output features) and b are split over TP; the input
// enters the TP region (copy_to_tp, or gather_sequence under sequence parallelism); the output
// stays split unless gather_output. Row-parallel: W's columns are split; the input is already split
// (the output of a column-parallel layer); partial outputs are summed (reduce_from_tp, or
// reduce_scatter_sequence under sequence parallelism) and b is added once, after the sum.
class LinearImpl : public torch::nn::Module {
 public:
  LinearImpl(int64_t in_features, int64_t out_features, bool bias = true);
  // A bias-free layer whose weight IS `shared_weight` [out, in] (the same tensor, registered here
  // too): tied weights, e.g. an LM head sharing the token embedding. DDP treats the tensor as one
  // parameter; a plan may give both layers styles that shard it the same way (it is sharded once).
  explicit LinearImpl(torch::Tensor shared_weight);
  torch::Tensor forward(const torch::Tensor& x);

  void parallelize_colwise(Group* tp, bool sequence_parallel, bool gather_output);
  void parallelize_rowwise(Group* tp, bool sequence_parallel);

  torch::Tensor weight, bias;  // full, or this rank's shard once parallelized
  const int64_t in_features, out_features;

 private:
  enum class Mode { kPlain, kColwise, kRowwise } mode_ = Mode::kPlain;
  Group* tp_ = nullptr;
  bool sequence_parallel_ = false;
  bool gather_output_ = false;
};
TORCH_MODULE(Linear);

// Lookup table [num_embeddings, dim] (init N(0, 0.02)). Vocab-parallel: rows split over TP; ids
// outside this rank's range give zeros, and the partial lookups are summed (reduce_from_tp, or
// reduce_scatter_sequence under sequence parallelism). unembed(h) is the tied output projection
// h W^T, giving this rank's vocab shard of the logits (use vocab_parallel_cross_entropy). Sequence-
// sharded (position embeddings under sequence parallelism): replicated table, output keeps this
// rank's chunk of the sequence dim (dim 1).
class EmbeddingImpl : public torch::nn::Module {
 public:
  EmbeddingImpl(int64_t num_embeddings, int64_t dim);
  torch::Tensor forward(const torch::Tensor& ids);
  torch::Tensor unembed(const torch::Tensor& h);

  void parallelize_vocab(Group* tp, bool sequence_parallel);
  void parallelize_sequence_sharded(Group* tp);

  torch::Tensor weight;
  const int64_t num_embeddings, dim;

 private:
  enum class Mode { kPlain, kVocabParallel, kSequenceSharded } mode_ = Mode::kPlain;
  Group* tp_ = nullptr;
  bool sequence_parallel_ = false;
};
TORCH_MODULE(Embedding);

// LayerNorm over the last dim (weight 1, bias 0, eps 1e-5). Under sequence parallelism it runs on
// this rank's sequence shard, so its weight and bias gradients are partial sums over TP: the plan
// (SequenceParallelNorm, which takes any norm module) marks them PartialGrad and DDP sums them
// over TP in the gradient sync.
class LayerNormImpl : public torch::nn::Module {
 public:
  explicit LayerNormImpl(int64_t dim, double eps = 1e-5);
  torch::Tensor forward(const torch::Tensor& x);

  torch::Tensor weight, bias;
  const int64_t dim;
  const double eps;
};
TORCH_MODULE(LayerNorm);

// Mean cross-entropy of logits [N, V] against targets [N]. With a TP group of size > 1, `logits`
// is this rank's vocab shard [N, V / tp] (rank r holds vocab [r V/tp, (r+1) V/tp)) and the full
// logits are never gathered: max, sum of exponentials and the target logit are all-reduced.
torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets, Group* vocab_group = nullptr);

}  // namespace meshddp::tp
