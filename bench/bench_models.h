// The models ddp_bench trains, behind one interface so that every candidate (local, meshddp*,
// reducer_*, naive) runs any of them: a deep MLP stack and a GPT-style decoder
// (the ~1B-parameter bf16 transformer preset). Models and data only: no DDP, no timing here.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>

namespace bench {

struct ModelOptions {
  std::string kind = "mlp";            // "mlp" or "gpt"
  int64_t layers = 24;                 // MLP: Linear layers; GPT: transformer blocks
  int64_t hidden = 1024;               // MLP: width; GPT: model width (heads x head dim)
  int64_t heads = 16;                  // GPT only; divides hidden
  int64_t seq = 1024;                  // GPT only: tokens per sequence (also the position table's size)
  int64_t vocab = 32000;               // GPT only
  int64_t batch = 32;                  // per rank: MLP rows, GPT sequences
  c10::ScalarType dtype = at::kFloat;  // params, and the float inputs (kFloat or kBFloat16)
  c10::Device device = at::kCPU;
  uint64_t seed = 0;  // every candidate builds its model from this seed: the same weights
};

// The candidates' view of a model. forward(input) gives the output that loss() reduces to a scalar.
// grads_in_buffer: every Linear goes through meshddp::linear_with_grad_in_buffer (its weight-
// gradient GEMM writes into the DDP flat buffer; same math as torch's Linear), else torch's Linear.
class BenchModel : public torch::nn::Module {
 public:
  virtual at::Tensor forward(const at::Tensor& input) = 0;
  virtual at::Tensor loss(const at::Tensor& output, const at::Tensor& target) const = 0;
  bool grads_in_buffer = false;

 protected:
  at::Tensor linear(const at::Tensor& x, torch::nn::LinearImpl& fc) const;
};

// The model of `options`, built from options.seed, moved to options.device and options.dtype
// (LayerNorm and embeddings too: a pure-bf16 model, as a bf16 trainer's params are).
std::shared_ptr<BenchModel> make_bench_model(const ModelOptions& options);

// One rank's fixed batch (the same every step; a different one per rank). MLP: input and target
// [batch, hidden] ~ N(0, 1) in options.dtype, MSE loss. GPT: input and target tokens [batch, seq],
// int64, uniform in [0, vocab), cross-entropy of the logits (computed in fp32) against the target.
struct Batch {
  at::Tensor input, target;
};
Batch make_batch(const ModelOptions& options, int64_t rank);

// "MLP stack 24 x Linear(1024, 1024)" or "GPT 18 blocks, hidden 2048, 16 heads, seq 1024, vocab 32000".
std::string describe(const ModelOptions& options);

}  // namespace bench
