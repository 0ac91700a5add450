// Test support: the tiny GPT (examples/02_dp_x_tp_gpt) trained on a DP x TP mesh, and its golden:
// the same model in one process on the whole global batch.
#pragma once

#include "examples/02_dp_x_tp_gpt/gpt.h"
#include "mesh/device_mesh.h"
#include "mesh/placement.h"

#include <vector>

namespace meshddp::test {

struct GptScenario {
  int64_t dp = 2, tp = 2;
  bool sequence_parallel = false;
  bool distributed_optimizer = false;
  // DdpConfig::data_parallel_sharding_strategy ("" = from distributed_optimizer). "optim" and
  // "optim_grads" step with the DistributedOptimizer; under "optim_grads" first_grads stays empty (no
  // whole gradient exists to read).
  std::string sharding_strategy = {};
  double clip = 0.0;  // max_norm: DistributedOptimizerConfig::clip_grad_norm, or meshddp::clip_grad_norm_ in plain DDP
  int steps = 6;
  int micro_batches = 1;
  int64_t global_batch = 8;
  size_t bucket_bytes = 4096;
  gpt::Config model{};
  std::vector<std::string> dims = {"dp", "tp"};  // the mesh's dim names (DP first, then TP)
  bool create_graph = false;                     // backward(create_graph=true) on every micro-batch
  // Checkpoints (plugin/training_checkpoint.h, with either optimizer): save into `save_dir` (as step
  // `save_before_step`) before that step; or start at step `first_step` from `load_dir`'s latest.
  std::string save_dir = {};
  int save_before_step = -1;
  std::string load_dir = {};
  int first_step = 0;
};

struct GptRun {
  std::vector<double> losses;                   // per step, mean over the global batch
  std::vector<torch::Tensor> first_grads;       // golden: full grads of step 0; distributed: rank-local
                                                // (ZeRO-1: NaN outside the elements this DP rank owns)
  std::vector<torch::Tensor> params;            // final; distributed: rank-local shards
  std::vector<double> grad_norms;               // per step (clipping runs only)
  std::vector<Placement> placements;            // distributed: each param's placement on this rank
  std::vector<int64_t> grads_written_in_place;  // distributed: per step, params whose gradient the layers
                                                // wrote straight into the flat buffer
  int64_t linear_weights = 0;                   // distributed: distinct weights of tp::Linear layers
};

constexpr uint64_t kGptSeed = 5;

// Golden: AdamW(lr 1e-2, torch's defaults otherwise) or, with clip > 0, after clip_grad_norm_.
GptRun train_gpt_golden(const GptScenario& s);

// Every rank's run (index = global rank) on a dp x tp mesh.
std::vector<GptRun> train_gpt_on_mesh(const GptScenario& s);

// The module's parameters, each tensor once (tied weights are registered under two names), in
// order of first appearance: what the golden's optimizer must get. Written here rather than taken
// from meshddp, so that the golden does not depend on the code under test.
std::vector<torch::Tensor> unique_parameters(const torch::nn::Module& module);

// The part of a golden tensor that a rank holding a param with placement `p` has.
torch::Tensor local_part(const torch::Tensor& golden, const Placement& p);

}  // namespace meshddp::test
