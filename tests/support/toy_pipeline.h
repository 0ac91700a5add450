// A 2-stage toy pipeline as rank threads on a dp 2 x pp 2 mesh (Gloo): stage 0 holds the token
// embedding (wte) and a layer, stage 1 a layer and the LM head, whose weight is tied to wte (declared
// on both stages). Activations and their gradients go between stages by c10d send/recv over the pp
// group; each stage runs its 2 micro-batches (all forwards, then all backwards on stage 0: GPipe)
// with set_requires_gradient_sync(false) before the last, then finalize_model_grads. The layouts put
// the tied param last in stage 0's buffer order and first in stage 1's (the regression case of a sum
// done after the ZeRO-1 reduce-scatter).
//
// Golden: one process on the whole batch (CPU), the head using wte itself (the tied model). The
// two copies of the tied weight must be bit-identical after every step (check_tied_params_identical).
// Used by tests/plugin/pipeline_tied_test.cpp (CPU) and tests/gpu/gpu_pipeline_test.cpp (the stages'
// params, buffers and collectives on CUDA tensors; activations cross stages through host memory, as
// Gloo's send/recv takes CPU tensors only).
#pragma once

#include <torch/torch.h>

#include <mutex>
#include <utility>
#include <vector>

namespace meshddp::test::toy_pipeline {

constexpr int64_t kVocab = 16, kHidden = 8, kBatch = 8, kSeq = 4, kMicro = 2, kSteps = 3, kDp = 2;
constexpr uint64_t kSeed = 11;
constexpr double kLr = 0.5;

struct Stage0Impl : torch::nn::Module {
  Stage0Impl() {
    wte = register_module("wte", torch::nn::Embedding(kVocab, kHidden));  // first registered: last in the layout
    fc0 = register_module("fc0", torch::nn::Linear(kHidden, kHidden));
  }
  torch::Tensor forward(const torch::Tensor& tokens) { return torch::tanh(fc0(wte(tokens))); }
  torch::nn::Embedding wte{nullptr};
  torch::nn::Linear fc0{nullptr};
};
TORCH_MODULE(Stage0);

struct Stage1Impl : torch::nn::Module {
  Stage1Impl() {
    fc1 = register_module("fc1", torch::nn::Linear(kHidden, kHidden));
    lm_head = register_module("lm_head", torch::nn::Linear(torch::nn::LinearOptions(kHidden, kVocab).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& h) { return lm_head(torch::tanh(fc1(h))); }
  torch::nn::Linear fc1{nullptr}, lm_head{nullptr};  // lm_head registered last: first in the layout
};
TORCH_MODULE(Stage1);

// The modules draw their initial values from torch's global generator: rank threads seed and draw
// under one lock, so that every thread builds the same values.
Stage0 make_stage0();
Stage1 make_stage1();

// Step `step`'s tokens and labels [kBatch, kSeq]; with `ignore`, some labels are -100 (not counted),
// more of them in the second half of the batch, so that ranks hold different counts of valid tokens.
std::pair<torch::Tensor, torch::Tensor> make_tokens(int64_t step, bool ignore);

// Cross entropy over the valid tokens: their mean, or their sum (`per_token`).
torch::Tensor loss_of(const torch::Tensor& logits, const torch::Tensor& labels, bool per_token);

// The golden: the tied model in one process on CPU, SGD on the whole batch (mean over its valid
// tokens). Returns wte, fc0.weight, fc0.bias, fc1.weight, fc1.bias after kSteps.
std::vector<torch::Tensor> golden(bool ignore);

struct RunOptions {
  bool zero1 = false;
  bool per_token = false;  // sum losses, finalize_model_grads(num_tokens)
  // "bf16_compress": the ZeRO-1 reduce-scatter goes through a bf16 copy and only this rank's shard
  // is written back (Gloo's in-place all-reduce would otherwise leave the whole bucket summed, which
  // hides a tied sum done after the reduce-scatter). Then bf16 rounding sets the tolerance.
  const char* comm_hook = "none";
  double tol = 2e-6;
  torch::Device device = torch::kCPU;  // where the stages' params, grad buffers and compute live
};

// Runs the pipeline on a dp 2 x pp 2 mesh and checks (gtest EXPECTs) each stage's params against the
// golden, and the tied copies after every step.
void run_pipeline(const RunOptions& run);

}  // namespace meshddp::test::toy_pipeline
