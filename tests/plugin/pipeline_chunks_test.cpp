// Virtual pipeline stages: two model chunks on one rank, each wrapped in its own DDP (its own buffers
// and buckets, pipeline_chunk_config's bucket policy), on 2 DP rank threads (Gloo). Per micro-batch,
// chunk 1's backward runs first and chunk 0's after it (the activation gradient handed over, as
// between stages); each chunk's sync is held until its own last micro-batch, chunk 1's is started
// (start_grad_sync) as soon as its last backward ends, so that it overlaps chunk 0's backward, and
// finalize_model_grads finishes both.
//
// The same under the optim_grads sharding strategy (gradients sharded, one DistributedOptimizer per chunk).
//
// Golden: the whole model (both halves) in one process on the whole batch, SGD. Tolerance 1e-6
// absolute and relative (fp32, 3e-8 measured).
#include "grad_buffer/grad_buffer.h"
#include "optimizer/distributed_optimizer.h"
#include "plugin/pipeline.h"
#include "tests/support/error_of.h"
#include "tests/support/mlp.h"
#include "tests/support/rank_threads.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <iostream>
#include <mutex>

using namespace meshddp;
using namespace meshddp::test;

namespace {

constexpr int64_t kIn = 6, kHidden = 12, kOut = 4, kBatch = 16, kMicro = 4, kSteps = 3;
constexpr uint64_t kSeed = 5;
constexpr double kLr = 0.2, kTol = 1e-6;

// The model's two halves, from one seed (the golden builds the same).
std::pair<torch::nn::Sequential, torch::nn::Sequential> make_halves() {
  // torch's global generator: rank threads seed and draw under one lock, so all build the same values.
  static std::mutex init_mutex;
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

}  // namespace

TEST(PipelineChunks, TwoChunksOnARankMatchOneProcess) {
  const auto want = golden();
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    auto [first, second] = make_halves();
    DdpConfig base;
    base.bucket_bytes = 256;
    DistributedDataParallel<torch::nn::SequentialImpl> c0(first.ptr(), mesh, "dp",
                                                          pipeline_chunk_config(base, 0, 0, 2));
    DistributedDataParallel<torch::nn::SequentialImpl> c1(second.ptr(), mesh, "dp",
                                                          pipeline_chunk_config(base, 0, 1, 2));
    EXPECT_GT(c0.grad_buffer()->layout().buckets.size(), 1u);  // bucketed: on the critical path
    EXPECT_EQ(c1.grad_buffer()->layout().buckets.size(), 1u);  // one bucket, synced in the bubble
    std::vector<torch::Tensor> params = c0.parameters();
    for (auto& p : c1.parameters()) params.push_back(p);
    torch::optim::SGD opt(params, torch::optim::SGDOptions(kLr));
    for (int64_t step = 0; step < kSteps; ++step) {
      c0.zero_grad_buffer();
      c1.zero_grad_buffer();
      auto [x, y] = make_batch(kSeed, step, kBatch, kIn, kOut);
      x = shard_rows(x, mesh.rank(), 2), y = shard_rows(y, mesh.rank(), 2);
      for (int64_t m = 0; m < kMicro; ++m) {
        const bool last = m == kMicro - 1;
        auto h0 = c0.forward(x.chunk(kMicro)[m]);
        auto h = h0.detach().requires_grad_(true);
        auto loss = torch::mse_loss(c1.forward(h), y.chunk(kMicro)[m]) / kMicro;
        c1.set_requires_gradient_sync(false);  // chunk 1: held, then started by hand after its last backward
        loss.backward();
        if (last) c1.start_grad_sync();
        EXPECT_EQ(c1.grad_buffer()->stats().buckets_launched, last ? 1 : 0);
        c0.set_requires_gradient_sync(last);  // chunk 0: its hooks launch its buckets on the last one
        h0.backward(h.grad());
        EXPECT_EQ(c0.grad_buffer()->stats().buckets_launched > 0, last);
      }
      EXPECT_EQ(finalize_model_grads({&c0, &c1}), -1);
      EXPECT_TRUE(c0.grad_sync_finished() && c1.grad_sync_finished());
      opt.step();
    }
    ASSERT_EQ(params.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_TRUE(torch::allclose(params[i], want[i], kTol, kTol))
          << "param " << i << " on rank " << mesh.rank() << ": max |diff| "
          << (params[i] - want[i]).abs().max().item<double>();
    }
  });
}

namespace {

// The same two chunks and schedule as above under a sharding strategy with the distributed optimizer
// (SGD, one DistributedOptimizer per chunk, stepped together): each rank's final params (all-gathered).
std::vector<std::vector<torch::Tensor>> train_two_chunks_sharded(const std::string& strategy) {
  std::vector<std::vector<torch::Tensor>> by_rank(2);
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    auto [first, second] = make_halves();
    DdpConfig base;
    base.bucket_bytes = 256;
    base.data_parallel_sharding_strategy = strategy;
    DistributedDataParallel<torch::nn::SequentialImpl> c0(first.ptr(), mesh, "dp",
                                                          pipeline_chunk_config(base, 0, 0, 2));
    DistributedDataParallel<torch::nn::SequentialImpl> c1(second.ptr(), mesh, "dp",
                                                          pipeline_chunk_config(base, 0, 1, 2));
    DistributedOptimizerConfig oc;
    oc.kind = OptimizerKind::kSgd;
    oc.lr = kLr;
    DistributedOptimizer o0(c0.grad_buffer(), oc), o1(c1.grad_buffer(), oc);
    for (int64_t step = 0; step < kSteps; ++step) {
      c0.zero_grad_buffer();
      c1.zero_grad_buffer();
      auto [x, y] = make_batch(kSeed, step, kBatch, kIn, kOut);
      x = shard_rows(x, mesh.rank(), 2), y = shard_rows(y, mesh.rank(), 2);
      for (int64_t m = 0; m < kMicro; ++m) {
        const bool last = m == kMicro - 1;
        auto h0 = c0.forward(x.chunk(kMicro)[m]);
        auto h = h0.detach().requires_grad_(true);
        auto loss = torch::mse_loss(c1.forward(h), y.chunk(kMicro)[m]) / kMicro;
        c1.set_requires_gradient_sync(false);
        loss.backward();
        if (last) c1.start_grad_sync();
        c0.set_requires_gradient_sync(last);
        h0.backward(h.grad());
      }
      finalize_model_grads({&c0, &c1});
      DistributedOptimizer::step_together({&o0, &o1});
    }
    o0.finish_param_sync();
    o1.finish_param_sync();
    for (auto& p : c0.parameters()) by_rank[mesh.rank()].push_back(p.detach().clone());
    for (auto& p : c1.parameters()) by_rank[mesh.rank()].push_back(p.detach().clone());
  });
  return by_rank;
}

}  // namespace

// Under optim_grads (gradients sharded, every micro-batch reduce-scattered into the shards, chunk 1's sync
// held and started by hand) the chunks train as under optim and as one process. Tolerance: kTol against
// one process (as above); against optim 1e-6: the 4 micro-batches' reduced means summed in the shard
// instead of summed before one reduce-scatter reorder fp32 sums (measured: printed).
TEST(PipelineChunks, TwoChunksUnderShardedGradientsMatchOptimAndOneProcess) {
  const auto want = golden();
  const auto optim = train_two_chunks_sharded(kShardOptim);
  const auto sharded = train_two_chunks_sharded(kShardOptimGrads);
  for (size_t rank = 0; rank < 2; ++rank) {
    ASSERT_EQ(sharded[rank].size(), want.size());
    double to_optim = 0, to_one = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      to_optim = std::max(to_optim, (sharded[rank][i] - optim[rank][i]).abs().max().item<double>());
      to_one = std::max(to_one, (sharded[rank][i] - want[i]).abs().max().item<double>());
      EXPECT_TRUE(torch::allclose(sharded[rank][i], want[i], kTol, kTol))
          << "param " << i << " on rank " << rank << ": max |diff| to one process "
          << (sharded[rank][i] - want[i]).abs().max().item<double>();
    }
    EXPECT_LE(to_optim, 1e-6) << "rank " << rank;
    std::cout << "[ optim_grads chunks on rank " << rank << ": max abs diff to optim " << to_optim
              << ", to one process " << to_one << " ]" << std::endl;
  }
}

// A chunk left out of finalize_model_grads (its sync would never finish, and the other ranks would
// wait for it) is named before any collective; so are chunks out of order.
TEST(PipelineChunks, FinalizeNamesAMissingOrMisorderedChunk) {
  run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    auto [first, second] = make_halves();
    DdpConfig base;
    DistributedDataParallel<torch::nn::SequentialImpl> c0(first.ptr(), mesh, "dp",
                                                          pipeline_chunk_config(base, 0, 0, 2));
    DistributedDataParallel<torch::nn::SequentialImpl> c1(second.ptr(), mesh, "dp",
                                                          pipeline_chunk_config(base, 0, 1, 2));
    EXPECT_THAT(error_of([&] { finalize_model_grads({&c0}); }),
                ::testing::AllOf(::testing::HasSubstr("chunk 0 of 2"), ::testing::HasSubstr("1 chunk(s) were given")));
    EXPECT_THAT(
        error_of([&] { finalize_model_grads({&c1, &c0}); }),
        ::testing::AllOf(::testing::HasSubstr("chunks[0] is chunk 1 of 2"), ::testing::HasSubstr("in chunk order")));
    EXPECT_THAT(error_of([&] { finalize_model_grads({&c0, &c0}); }), ::testing::HasSubstr("given twice"));
    EXPECT_THAT(error_of([&] { finalize_model_grads({}); }), ::testing::HasSubstr("no chunks"));
    DdpConfig bad = base;
    bad.virtual_pipeline_chunk = 2;
    bad.virtual_pipeline_size = 2;
    auto [other, unused] = make_halves();
    EXPECT_THAT(error_of([&] { DistributedDataParallel<torch::nn::SequentialImpl> c(other.ptr(), mesh, "dp", bad); }),
                ::testing::HasSubstr("virtual_pipeline_chunk = 2 must be < virtual_pipeline_size = 2"));
  });
}

// A pipeline holds chunks of different module types through their base, std::unique_ptr<DdpEngine>:
// deleting one through it destroys the whole DistributedDataParallel<M>, whose module reference goes
// with it (the module is freed once the caller lets go of it too).
TEST(PipelineChunks, AChunkDeletedThroughItsEngineReleasesItsModule) {
  static_assert(std::has_virtual_destructor_v<DdpEngine>, "chunks are deleted through DdpEngine");
  run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    std::weak_ptr<torch::nn::SequentialImpl> module;
    {
      auto [first, second] = make_halves();
      std::unique_ptr<DdpEngine> chunk =
          std::make_unique<DistributedDataParallel<torch::nn::SequentialImpl>>(first.ptr(), mesh, "dp", DdpConfig{});
      module = first.ptr();
      first = nullptr;
      EXPECT_FALSE(module.expired()) << "the chunk holds its module";
      chunk.reset();
    }
    EXPECT_TRUE(module.expired()) << "deleting the chunk through DdpEngine left its module alive";
  });
}
