// Test support: ZeRO-1 training (DistributedDataParallel + DistributedOptimizer) of the test MLP on
// DP ranks, and the golden: the same model and optimizer, unsharded, in one process on the whole
// global batch (torch::optim::AdamW / SGD, torch::nn::utils::clip_grad_norm_).
#pragma once

#include "grad_buffer/param_gather.h"
#include "optimizer/distributed_optimizer.h"
#include "optimizer/lr_scheduler.h"
#include "plugin/distributed_data_parallel.h"
#include "tests/support/mlp.h"

#include <functional>
#include <string>
#include <vector>

namespace meshddp::test {

constexpr int64_t kZeroIn = 12, kZeroHidden = 24, kZeroOut = 6, kZeroBatch = 32;
constexpr uint64_t kZeroSeed = 99;

struct ZeroScenario {
  int world = 2;
  int steps = 20;
  int micro_batches = 1;
  OptimizerKind kind = OptimizerKind::kAdamW;
  bool overlap_param_gather = false;
  double clip = 0.0;
  bool bf16 = false;          // bf16 params, fp32 main grads and master weights
  size_t bucket_bytes = 512;  // several buckets, params straddling shards
  int64_t hidden = kZeroHidden;
  std::optional<LrScheduleConfig> schedule = {};  // drives both the golden's and the ZeRO-1 optimizer
  FusedStep fused_step = FusedStep::kAuto;        // kAlways: the fused kernels on CPU (fused_step_test)
  int64_t instances = 1;                          // DdpConfig::num_distributed_optimizer_instances
  std::string strategy = "optim";                 // DdpConfig::data_parallel_sharding_strategy
};

// lr 1e-2, AdamW betas (0.9, 0.999) eps 1e-8 weight decay 0.1; SGD momentum 0.9 weight decay 0.01;
// no weight decay on biases (a group rule) in both.
DistributedOptimizerConfig zero_optimizer_config(const ZeroScenario& s);

// Final params (fp32 copies) of the golden run; `per_step` (optional) gets them after every step.
std::vector<torch::Tensor> train_zero_golden(const ZeroScenario& s, std::vector<double>* norms = nullptr,
                                             std::vector<std::vector<torch::Tensor>>* per_step = nullptr);

// One rank's training state; steps [first, last) of the shared data stream.
struct ZeroRank {
  ZeroRank(DeviceMesh& mesh, const ZeroScenario& s, uint64_t init_seed);
  std::vector<StepResult> train(int first_step, int last_step);
  // fp32 copies, after finish_param_sync() (under "optim_grads_params" every unit gathered for the read)
  std::vector<torch::Tensor> params();

  const ZeroScenario scenario;
  DeviceMesh& mesh;
  Mlp model{nullptr};
  std::unique_ptr<DistributedDataParallel<MlpImpl>> ddp;
  std::unique_ptr<DistributedOptimizer> opt;
  std::unique_ptr<LrScheduler> scheduler;  // when scenario.schedule is set; steps after each unskipped step
};

// The golden MLP holding train_zero_golden(s)'s params after s.steps: what a forward of the trained
// model must give.
Mlp trained_zero_golden_model(const ZeroScenario& s);

// For tests of a forward that overlaps the param all-gathers: rank 0 overwrites every part of its param
// buffer that it does not own with 1e6 while the others wait 300 ms, then every rank launches the
// all-gathers asynchronously, so they are in flight when rank 0's next forward starts. Returns the gather.
ParamGather* start_gathers_over_a_poisoned_param_buffer(ZeroRank& rank);

// Trains on s.world ranks; checks every rank ends with identical params; returns rank 0's.
// `per_rank` (optional) runs on each rank after training.
std::vector<torch::Tensor> train_zero(const ZeroScenario& s, std::vector<std::vector<StepResult>>* results = nullptr);

// max |a - b| over all params.
double max_abs_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b);

}  // namespace meshddp::test
