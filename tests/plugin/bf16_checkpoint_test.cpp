// Checkpoints of a bf16 run (bf16 params, fp32 main grads, ZeRO-1 with fp32 masters): the tiny GPT
// saved at dp 2 x tp 2 and loaded at dp 4 and at dp 1 holds the saved fp32 masters and fp32 AdamW
// state bit for bit, with no round trip through bf16 (docs/reference/optimizer.md "Precision").
#include "checkpoint/store.h"
#include "examples/02_dp_x_tp_gpt/gpt.h"
#include "examples/02_dp_x_tp_gpt/gpt_plan.h"
#include "grad_buffer/grad_buffer.h"
#include "optimizer/distributed_optimizer.h"
#include "plugin/distributed_data_parallel.h"
#include "plugin/training_checkpoint.h"
#include "tests/support/rank_threads.h"
#include "tests/support/temp_dir.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>

using namespace meshddp;
using namespace meshddp::test;

namespace {

// Every "optim/..." tensor of the optimizer (masters, exp_avg, exp_avg_sq), whole (as if DP and TP
// were 1), assembled from every rank's pieces. Elements no rank holds stay NaN.
class WholeState {
 public:
  void add(DistributedOptimizer& zero) {
    for (const CheckpointTensor& t : zero.checkpoint_tensors(/*for_save=*/true)) {
      if (t.key.rfind("optim/", 0) != 0) continue;
      std::lock_guard<std::mutex> lock(mutex_);
      auto [it, fresh] = state_.try_emplace(t.key);
      if (fresh) it->second = torch::full(t.global_shape, std::nan(""), torch::kFloat);
      at::Tensor local = it->second;
      if (t.slice.dim >= 0) {
        const int64_t size = local.size(t.slice.dim) / t.slice.tp_size;
        local = local.narrow(t.slice.dim, t.slice.tp_rank * size, size);
      }
      at::Tensor flat = local.contiguous().view({-1});
      flat.narrow(0, t.begin, t.end - t.begin).copy_(t.data);
      local.copy_(flat.view(local.sizes()));
    }
  }
  const std::map<std::string, at::Tensor>& tensors() const { return state_; }

 private:
  std::mutex mutex_;
  std::map<std::string, at::Tensor> state_;
};

// One rank of a bf16 GPT run on `mesh` (dp x tp): trains `steps` steps then saves into `save_dir`, or
// loads `load_dir`'s latest; then adds its optimizer state to `whole`.
void bf16_rank(DeviceMesh& mesh, int steps, const std::string& save_dir, const std::string& load_dir,
               WholeState& whole) {
  const gpt::Config c{};
  gpt::Gpt model{nullptr};
  {
    static std::mutex mutex;  // the default generator is process-global; ranks are threads
    std::lock_guard<std::mutex> lock(mutex);
    torch::manual_seed(3);
    model = gpt::Gpt(c);
  }
  model->to(torch::kBFloat16);
  parallelize(*model, mesh, gpt::tp_plan(c));
  DdpConfig config;
  config.use_distributed_optimizer = true;
  config.grad_reduce_in_fp32 = true;
  config.bucket_bytes = 4096;
  DistributedDataParallel ddp(model.ptr(), mesh, "dp", config);
  DistributedOptimizerConfig oc;
  oc.lr = 1e-2;
  DistributedOptimizer zero(ddp.grad_buffer(), oc);
  const TrainingState state{model.ptr().get(), &ddp, &zero, nullptr};
  if (!load_dir.empty()) load_checkpoint(state, load_dir);
  const int64_t dp = mesh.size("dp"), dp_rank = mesh.coordinate("dp");
  for (int step = 0; step < steps; ++step) {
    ddp.zero_grad_buffer();
    auto [ids, targets] = gpt::make_batch(c, 3, step, 8);
    auto mine = [&](const torch::Tensor& t) { return t.chunk(dp, 0)[dp_rank]; };
    auto logits = ddp.forward(mine(ids)).to(torch::kFloat);
    tp::cross_entropy(logits.view({-1, logits.size(-1)}), mine(targets).reshape({-1}), mesh["tp"].get()).backward();
    zero.step();
  }
  whole.add(zero);
  if (!save_dir.empty()) save_checkpoint(state, save_dir, steps);
}

}  // namespace

TEST(Bf16Checkpoint, Fp32MastersAndAdamWStateSavedAtTwoByTwoLoadBitForBitAtDpFourAndDpOne) {
  const std::string dir = fresh_dir("bf16-ckpt");
  WholeState saved, at_dp4, at_dp1;
  run_on_mesh({2, 2}, {"dp", "tp"}, [&](DeviceMesh& mesh) { bf16_rank(mesh, 3, dir, "", saved); });
  run_on_mesh({4, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) { bf16_rank(mesh, 0, "", dir, at_dp4); });
  run_on_mesh({1, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) { bf16_rank(mesh, 0, "", dir, at_dp1); });
  remove_dir(dir);

  int64_t masters = 0, not_bf16 = 0;
  for (const auto& [key, value] : saved.tensors()) {
    ASSERT_FALSE(value.isnan().any().item<bool>()) << key << " was not assembled whole from the 2x2 ranks";
    for (auto* loaded : {&at_dp4, &at_dp1}) {
      const char* where = loaded == &at_dp4 ? "dp 4" : "dp 1";
      const auto it = loaded->tensors().find(key);
      ASSERT_NE(it, loaded->tensors().end()) << key << " is missing at " << where;
      // Bit for bit: the same fp32 bits, NaN or not (none are NaN here).
      EXPECT_TRUE(torch::equal(value.view(torch::kInt32), it->second.view(torch::kInt32)))
          << key << " saved at 2x2 differs at " << where << ": max |diff| "
          << (value - it->second).abs().max().item<float>();
    }
    if (key.rfind("optim/master/", 0) == 0) {
      ++masters;
      not_bf16 += (value.to(torch::kBFloat16).to(torch::kFloat) != value).sum().item<int64_t>();
    }
  }
  EXPECT_GT(masters, 10) << "fp32 masters saved (one per bf16 param)";
  // The masters carry more than bf16 holds (else a bf16 round trip would pass unseen).
  EXPECT_GT(not_bf16, 0) << "every saved fp32 master is a bf16 value: the masters were rounded to bf16";
  std::cout << "[ " << masters << " masters, " << saved.tensors().size() << " optimizer tensors; " << not_bf16
            << " master elements not representable in bf16 ]" << std::endl;
}
