// Test support: a small MLP and its synthetic data, built identically from a seed on every rank and
// in the golden single-process run.
#pragma once

#include <torch/torch.h>

namespace meshddp::test {

struct MlpImpl : torch::nn::Module {
  // in -> hidden -> hidden -> out with tanh; `with_side` adds a layer used only when
  // forward(x, use_side=true), to test params that get no gradient on some steps.
  MlpImpl(int64_t in, int64_t hidden, int64_t out, bool with_side = false);
  torch::Tensor forward(const torch::Tensor& x, bool use_side = false);

  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr}, side{nullptr};
  // true: the layers run meshddp::linear_with_grad_in_buffer (same math; under DDP their weight
  // gradients are written straight into the flat buffer) instead of torch::nn::Linear::forward.
  bool grads_in_buffer = false;
};
TORCH_MODULE(Mlp);

// Builds the model from `seed` (same seed -> bit-identical params on every rank).
Mlp make_mlp(uint64_t seed, int64_t in, int64_t hidden, int64_t out, bool with_side = false);

// Step `step`'s global batch: x [batch, in], y [batch, out], from (seed, step).
std::pair<torch::Tensor, torch::Tensor> make_batch(uint64_t seed, int64_t step, int64_t batch, int64_t in, int64_t out);

// Rows [rank * batch/world, (rank+1) * batch/world) of t.
torch::Tensor shard_rows(const torch::Tensor& t, int64_t rank, int64_t world);

}  // namespace meshddp::test
