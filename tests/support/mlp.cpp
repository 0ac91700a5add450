#include "tests/support/mlp.h"

#include "tp/linear_with_grad_in_buffer.h"

#include <mutex>

namespace meshddp::test {

using meshddp::linear_with_grad_in_buffer;

MlpImpl::MlpImpl(int64_t in, int64_t hidden, int64_t out, bool with_side) {
  fc1 = register_module("fc1", torch::nn::Linear(in, hidden));
  fc2 = register_module("fc2", torch::nn::Linear(hidden, hidden));
  if (with_side) side = register_module("side", torch::nn::Linear(hidden, hidden));
  fc3 = register_module("fc3", torch::nn::Linear(hidden, out));
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x, bool use_side) {
  auto linear = [this](torch::nn::Linear& fc, const torch::Tensor& in) {
    return grads_in_buffer ? linear_with_grad_in_buffer(in, fc->weight, fc->bias) : fc(in);
  };
  auto h = torch::tanh(linear(fc1, x));
  h = torch::tanh(linear(fc2, h));
  if (use_side && side) h = h + torch::tanh(linear(side, h));
  return linear(fc3, h);
}

Mlp make_mlp(uint64_t seed, int64_t in, int64_t hidden, int64_t out, bool with_side) {
  // The default generator is process-global and ranks are threads: seed and build under one lock.
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  torch::manual_seed(seed);
  return Mlp(in, hidden, out, with_side);
}

std::pair<torch::Tensor, torch::Tensor> make_batch(uint64_t seed, int64_t step, int64_t batch, int64_t in,
                                                   int64_t out) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 1000003 + step);
  auto x = torch::randn({batch, in}, gen);
  auto y = torch::randn({batch, out}, gen);
  return {x, y};
}

torch::Tensor shard_rows(const torch::Tensor& t, int64_t rank, int64_t world) {
  const int64_t rows = t.size(0) / world;
  return t.narrow(0, rank * rows, rows);
}

}  // namespace meshddp::test
