// Pipelines under the optim_grads_params sharding strategy (ZeRO-3; Note [Sharded parameters] in
// grad_buffer/sharded_params.h): each stage's (or chunk's) DDP keeps its own sharded params, and the
// schedule interleaves micro-batches, so the forward of micro-batch k+1 (which ends by releasing every
// unit) runs before the backward of micro-batch k, which must gather its units again.
//
//   - pp 2 x dp 2 (rank threads, Gloo), one chunk per stage, 1F1B with 4 micro-batches: stage 0 runs
//     F0 F1 B0 F2 B1 F3 B2 B3, stage 1 F0 B0 F1 B1 ... Activations and their gradients go between the
//     stages through memory (a mailbox shared by the threads: the schedule is what is tested, not p2p).
//   - dp 2, two chunks on one rank (virtual stages), the forward of micro-batch k+1 through both
//     chunks before the backward of micro-batch k: two ShardedParams live on one thread.
//
// Golden: the whole model in one process on the whole batch, SGD (kTol, as pipeline_chunks_test.cpp).
// Against the optim strategy's run of the same schedule: 1e-6 (each micro-batch reduce-scattered into
// the shards instead of summed before one reduce-scatter reorders fp32 sums; measured: printed). Every
// backward ends with only the shards resident, and a step gathers each unit exactly once per forward
// and once per backward of every micro-batch (a unit released after a backward and not gathered again
// would read freed bytes; one gathered more often means units released early).
#include "grad_buffer/grad_buffer.h"
#include "grad_buffer/sharded_params.h"
#include "optimizer/distributed_optimizer.h"
#include "plugin/pipeline.h"
#include "tests/support/mlp.h"
#include "tests/support/rank_threads.h"

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <iostream>
#include <map>
#include <mutex>

using namespace meshddp;
using namespace meshddp::test;

namespace {

constexpr int64_t kIn = 6, kHidden = 12, kOut = 4, kBatch = 16, kMicro = 4, kSteps = 3, kDp = 2;
constexpr uint64_t kSeed = 7;
constexpr double kLr = 0.2, kTol = 1e-6, kToOptim = 1e-6;

using Chunk = DistributedDataParallel<torch::nn::SequentialImpl>;

// The model's two halves, from one seed (the golden builds the same); each Linear is an FSDP unit.
std::pair<torch::nn::Sequential, torch::nn::Sequential> make_halves() {
  static std::mutex init_mutex;  // torch's global generator: rank threads draw under one lock
  std::lock_guard<std::mutex> lock(init_mutex);
  torch::manual_seed(kSeed);
  torch::nn::Sequential first(torch::nn::Linear(kIn, kHidden), torch::nn::Tanh(), torch::nn::Linear(kHidden, kHidden),
                              torch::nn::Tanh());
  torch::nn::Sequential second(torch::nn::Linear(kHidden, kHidden), torch::nn::Tanh(),
                               torch::nn::Linear(kHidden, kOut));
  return {first, second};
}

std::vector<torch::Tensor> golden() {
  auto [first, second] = make_halves();
  std::vector<torch::Tensor> params = first->parameters();
  for (auto& p : second->parameters()) params.push_back(p);
  torch::optim::SGD opt(params, torch::optim::SGDOptions(kLr));
  for (int64_t step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    auto [x, y] = make_batch(kSeed, step, kBatch, kIn, kOut);
    torch::mse_loss(second->forward(first->forward(x)), y).backward();
    opt.step();
  }
  std::vector<torch::Tensor> out;
  for (auto& p : params) out.push_back(p.detach().clone());
  return out;
}

// Tensors handed between rank threads: take() waits for the matching put().
class Mailbox {
 public:
  void put(const std::string& key, torch::Tensor t) {
    std::lock_guard<std::mutex> lock(mutex_);
    box_[key] = std::move(t);
    ready_.notify_all();
  }
  torch::Tensor take(const std::string& key) {
    std::unique_lock<std::mutex> lock(mutex_);
    const bool arrived = ready_.wait_for(lock, kTestTimeout, [&] { return box_.count(key) > 0; });
    TORCH_CHECK(arrived, "Mailbox: nothing arrived for '", key, "' within the test timeout");
    torch::Tensor t = box_.at(key);
    box_.erase(key);
    return t;
  }

 private:
  std::mutex mutex_;
  std::condition_variable ready_;
  std::map<std::string, torch::Tensor> box_;
};

ShardedParams* sharded_of(Chunk& chunk) { return chunk.grad_buffer()->param_buffer()->sharded(); }

// Every backward leaves only the shards (each param got its gradient, so each unit was released).
void expect_only_shards_resident(Chunk& chunk, const std::string& where) {
  if (ShardedParams* sharded = sharded_of(chunk)) {
    EXPECT_EQ(sharded->resident_bytes(), sharded->shard_bytes()) << where << ": a unit stayed gathered";
  }
}

// This rank's params after training, whole (every unit gathered, on every rank at once).
std::vector<torch::Tensor> whole_params(std::vector<Chunk*> chunks) {
  std::vector<torch::Tensor> out;
  for (Chunk* chunk : chunks) {
    if (ShardedParams* sharded = sharded_of(*chunk)) sharded->gather_all();
    for (auto& p : chunk->parameters()) out.push_back(p.detach().clone());
    if (ShardedParams* sharded = sharded_of(*chunk)) sharded->release_all();
  }
  return out;
}

DistributedOptimizerConfig sgd() {
  DistributedOptimizerConfig oc;
  oc.kind = OptimizerKind::kSgd;
  oc.lr = kLr;
  return oc;
}

// pp 2 x dp 2, 1F1B. Returns the params by global rank: stage 0's ranks hold the first half's.
std::vector<std::vector<torch::Tensor>> train_pp2_dp2(const std::string& strategy) {
  std::vector<std::vector<torch::Tensor>> by_rank(4);
  Mailbox mailbox;
  run_on_mesh({2, kDp}, {"pp", "dp"}, [&](DeviceMesh& mesh) {
    const int64_t stage = mesh.coordinate("pp"), dp = mesh.coordinate("dp");
    auto [first, second] = make_halves();
    DdpConfig base;
    base.bucket_bytes = 256;
    base.data_parallel_sharding_strategy = strategy;
    Chunk chunk((stage == 0 ? first : second).ptr(), mesh, "dp", pipeline_chunk_config(base, stage, 0, 1));
    DistributedOptimizer opt(chunk.grad_buffer(), sgd());
    ShardedParams* sharded = sharded_of(chunk);
    for (int64_t step = 0; step < kSteps; ++step) {
      chunk.zero_grad_buffer();
      auto [x, y] = make_batch(kSeed, step, kBatch, kIn, kOut);
      x = shard_rows(x, dp, kDp), y = shard_rows(y, dp, kDp);
      const auto key = [&](const char* what, int64_t m) {
        return std::string(what) + std::to_string(step) + "." + std::to_string(dp) + "." + std::to_string(m);
      };
      std::vector<torch::Tensor> outputs(kMicro), inputs(kMicro);  // this stage's, per micro-batch
      const auto forward = [&](int64_t m) {
        if (stage == 0) {
          outputs[m] = chunk.forward(x.chunk(kMicro)[m]);
          mailbox.put(key("activation", m), outputs[m].detach().clone());
        } else {
          inputs[m] = mailbox.take(key("activation", m)).requires_grad_(true);
          outputs[m] = torch::mse_loss(chunk.forward(inputs[m]), y.chunk(kMicro)[m]) / kMicro;
        }
      };
      const auto backward = [&](int64_t m) {
        chunk.set_requires_gradient_sync(m == kMicro - 1);
        if (stage == 0) {
          outputs[m].backward(mailbox.take(key("gradient", m)));
        } else {
          outputs[m].backward();
          mailbox.put(key("gradient", m), inputs[m].grad().clone());
        }
        expect_only_shards_resident(chunk, "stage " + std::to_string(stage) + " after backward " + std::to_string(m));
      };
      const int64_t gathers_before = sharded ? sharded->gathers() : 0;
      const int64_t warmup = 1 - stage;  // 1F1B: pp - stage - 1 forwards before the steady state
      for (int64_t m = 0; m < warmup; ++m) forward(m);
      for (int64_t m = warmup; m < kMicro; ++m) {
        forward(m);
        backward(m - warmup);
      }
      for (int64_t m = kMicro - warmup; m < kMicro; ++m) backward(m);
      finalize_model_grads({&chunk});
      if (sharded) {  // two Linear units: each gathered for every forward and every backward
        EXPECT_EQ(sharded->gathers() - gathers_before, 2 * kMicro * sharded->num_units())
            << "stage " << stage << " at step " << step;
      }
      DistributedOptimizer::step_together({&opt});
    }
    opt.finish_param_sync();
    by_rank[mesh.rank()] = whole_params({&chunk});
  });
  return by_rank;
}

// dp 2, both halves as two chunks on each rank; micro-batch m+1's forward before micro-batch m's backward.
std::vector<std::vector<torch::Tensor>> train_two_chunks_interleaved(const std::string& strategy) {
  std::vector<std::vector<torch::Tensor>> by_rank(kDp);
  run_on_mesh({kDp}, {"dp"}, [&](DeviceMesh& mesh) {
    auto [first, second] = make_halves();
    DdpConfig base;
    base.bucket_bytes = 256;
    base.data_parallel_sharding_strategy = strategy;
    Chunk c0(first.ptr(), mesh, "dp", pipeline_chunk_config(base, 0, 0, 2));
    Chunk c1(second.ptr(), mesh, "dp", pipeline_chunk_config(base, 0, 1, 2));
    DistributedOptimizer o0(c0.grad_buffer(), sgd()), o1(c1.grad_buffer(), sgd());
    for (int64_t step = 0; step < kSteps; ++step) {
      c0.zero_grad_buffer();
      c1.zero_grad_buffer();
      auto [x, y] = make_batch(kSeed, step, kBatch, kIn, kOut);
      x = shard_rows(x, mesh.rank(), kDp), y = shard_rows(y, mesh.rank(), kDp);
      std::vector<torch::Tensor> h0(kMicro), h(kMicro), loss(kMicro);
      const auto forward = [&](int64_t m) {
        h0[m] = c0.forward(x.chunk(kMicro)[m]);
        h[m] = h0[m].detach().requires_grad_(true);
        loss[m] = torch::mse_loss(c1.forward(h[m]), y.chunk(kMicro)[m]) / kMicro;
      };
      const auto backward = [&](int64_t m) {
        const bool last = m == kMicro - 1;
        c1.set_requires_gradient_sync(false);  // chunk 1: held, then started by hand after its last backward
        loss[m].backward();
        if (last) c1.start_grad_sync();
        c0.set_requires_gradient_sync(last);
        h0[m].backward(h[m].grad());
        expect_only_shards_resident(c0, "chunk 0 after backward " + std::to_string(m));
        expect_only_shards_resident(c1, "chunk 1 after backward " + std::to_string(m));
      };
      forward(0);
      for (int64_t m = 1; m < kMicro; ++m) {
        forward(m);
        backward(m - 1);
      }
      backward(kMicro - 1);
      finalize_model_grads({&c0, &c1});
      DistributedOptimizer::step_together({&o0, &o1});
    }
    o0.finish_param_sync();
    o1.finish_param_sync();
    by_rank[mesh.rank()] = whole_params({&c0, &c1});
  });
  return by_rank;
}

// `got` and `optim` by rank against the golden (`halves_of(rank)`: the golden's params that rank holds).
void expect_matches(const std::vector<std::vector<torch::Tensor>>& got,
                    const std::vector<std::vector<torch::Tensor>>& optim,
                    const std::function<std::vector<torch::Tensor>(size_t)>& golden_of, const std::string& what) {
  for (size_t rank = 0; rank < got.size(); ++rank) {
    const std::vector<torch::Tensor> want = golden_of(rank);
    ASSERT_EQ(got[rank].size(), want.size()) << "rank " << rank;
    double to_optim = 0, to_one = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      to_optim = std::max(to_optim, (got[rank][i] - optim[rank][i]).abs().max().item<double>());
      to_one = std::max(to_one, (got[rank][i] - want[i]).abs().max().item<double>());
      EXPECT_TRUE(torch::allclose(got[rank][i], want[i], kTol, kTol))
          << what << ": param " << i << " on rank " << rank << ": max |diff| to one process "
          << (got[rank][i] - want[i]).abs().max().item<double>();
    }
    EXPECT_LE(to_optim, kToOptim) << what << ": rank " << rank;
    std::cout << "[ " << what << " on rank " << rank << ": max abs diff to optim " << to_optim << ", to one process "
              << to_one << " ]" << std::endl;
  }
}

}  // namespace

TEST(PipelineShardedParams, TwoStagesOnA1F1BScheduleMatchOptimAndOneProcessAtPp2Dp2) {
  const std::vector<torch::Tensor> want = golden();
  const size_t first_half = make_halves().first->parameters().size();
  const auto optim = train_pp2_dp2(kShardOptim);
  const auto zero3 = train_pp2_dp2(kShardOptimGradsParams);
  expect_matches(
      zero3, optim,
      [&](size_t rank) {  // global rank = pp * dp_size + dp
        const bool first = rank < static_cast<size_t>(kDp);
        return first ? std::vector<torch::Tensor>(want.begin(), want.begin() + first_half)
                     : std::vector<torch::Tensor>(want.begin() + first_half, want.end());
      },
      "optim_grads_params pp 2 x dp 2");
}

TEST(PipelineShardedParams, TwoChunksOnARankWithInterleavedMicroBatchesMatchOptimAndOneProcess) {
  const std::vector<torch::Tensor> want = golden();
  const auto optim = train_two_chunks_interleaved(kShardOptim);
  const auto zero3 = train_two_chunks_interleaved(kShardOptimGradsParams);
  expect_matches(zero3, optim, [&](size_t) { return want; }, "optim_grads_params two chunks");
}
