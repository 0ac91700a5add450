// GradBuffer under the "optim_grads" sharding strategy (ZeRO-2; Note [Sharded gradients] in
// grad_buffer/grad_shards.cpp), on real Gloo groups (ranks as threads): a rank's gradient storage is its
// shards plus the buckets in flight, the shards equal "optim"'s exactly (with accumulation too), and the
// strategy's settings and refusals are named.
#include "grad_buffer/grad_buffer.h"
#include "mesh/switches.h"
#include "tests/support/error_of.h"
#include "tests/support/rank_threads.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

using namespace meshddp;
using meshddp::test::error_of;
using ::testing::HasSubstr;

namespace {

constexpr int64_t kParams = 16, kParamNumel = 64;

std::vector<NamedParam> make_params() {
  std::vector<NamedParam> params;
  for (int64_t i = 0; i < kParams; ++i) {
    params.push_back({"layer" + std::to_string(i) + ".weight", at::zeros({kParamNumel}).requires_grad_(true)});
  }
  return params;
}

// Param i gets gradient (rank + 1) * (i + 1) + micro_batch: exact in fp32, different per param and rank.
void backward(const std::vector<NamedParam>& params, int rank, int micro_batch) {
  at::Tensor loss;
  for (int64_t i = 0; i < kParams; ++i) {  // autograd runs the last term first: bucket 0's params fire first
    auto term = (params[i].param * static_cast<double>((rank + 1) * (i + 1) + micro_batch)).sum();
    loss = loss.defined() ? loss + term : term;
  }
  torch::autograd::backward({loss});
}

GradBufferConfig strategy(const char* name) {
  GradBufferConfig config;
  config.bucket_bytes = 2 * kParamNumel * sizeof(float);  // two params a bucket: 8 buckets
  config.data_parallel_sharding_strategy = name;
  return config;
}

// Trains `micro_batches` micro-batches under `name` and returns this rank's shards, bucket by bucket.
// marks_last = false: every micro-batch runs as a non-last one (all under no_sync()), then the sync.
std::vector<at::Tensor> shards_after(DeviceMesh& mesh, const char* name, int micro_batches, int64_t* bytes = nullptr,
                                     bool marks_last = true) {
  auto params = make_params();
  GradBuffer buffer(params, mesh["dp"], strategy(name));
  for (int m = 0; m < micro_batches; ++m) {
    buffer.set_is_last_microbatch(marks_last && m == micro_batches - 1);
    backward(params, mesh.rank(), m);
  }
  buffer.finish_grad_sync();
  std::vector<at::Tensor> shards;
  for (int64_t b = 0; b < static_cast<int64_t>(buffer.layout().buckets.size()); ++b) {
    shards.push_back(buffer.bucket_shard(b).clone());
  }
  if (bytes != nullptr) *bytes = buffer.grad_buffer_bytes();
  return shards;
}

}  // namespace

// The whole buffer is 16 x 64 fp32 = 4 KiB; at dp 2 the shards are 2 KiB and each block of the pool one
// bucket (2 params, 512 B). Holding the whole buffer (as "optim" does) reports >= 4 KiB.
TEST(GradBufferShardedGrads, HoldsOnlyItsShardsAndTheBucketsInFlight) {
  test::run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    const int64_t whole = kParams * kParamNumel * 4, bucket = 2 * kParamNumel * 4;
    int64_t optim = 0, sharded = 0;
    shards_after(mesh, kShardOptim, 1, &optim);
    shards_after(mesh, kShardOptimGrads, 2, &sharded);
    EXPECT_EQ(optim, whole);
    EXPECT_GE(sharded, whole / 2 + bucket) << "the shards and at least one bucket in flight";
    EXPECT_LE(sharded, whole / 2 + 2 * bucket) << "the shards and at most two buckets in flight";
  });
}

// Without accumulation the reduce-scatter is the same and the shard is 0 + it: bit for bit. With three
// micro-batches each is reduce-scattered and summed into the shard: exact here, the values being small
// integers over a power-of-two DP size.
TEST(GradBufferShardedGrads, ShardsEqualTheOptimStrategysWithAndWithoutAccumulation) {
  test::run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    for (int micro_batches : {1, 3}) {
      const auto want = shards_after(mesh, kShardOptim, micro_batches);
      const auto got = shards_after(mesh, kShardOptimGrads, micro_batches);
      ASSERT_EQ(got.size(), want.size());
      for (size_t b = 0; b < want.size(); ++b) {
        EXPECT_TRUE(at::equal(got[b], want[b]))
            << micro_batches << " micro-batch(es), bucket " << b << ": " << got[b] << " vs " << want[b];
      }
    }
  });
}

TEST(GradBufferShardedGrads, MainGradAfterTheSyncIsRefusedNamingTheParam) {
  test::run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    auto params = make_params();
    GradBuffer buffer(params, mesh["dp"], strategy(kShardOptimGrads));
    backward(params, mesh.rank(), 0);
    buffer.finish_grad_sync();
    EXPECT_FALSE(params[3].param.grad().defined()) << "no param's .grad outlives its bucket";
    const std::string msg = error_of([&] { buffer.main_grad(3); });
    EXPECT_THAT(msg, HasSubstr("parameter 'layer3.weight' has no whole main gradient"));
    EXPECT_THAT(msg, HasSubstr("bucket_shard"));
  });
}

TEST(GradBufferConfig, ShardingStrategyFollowsOrContradictsUseDistributedOptimizer) {
  GradBufferConfig config;
  EXPECT_EQ(config.sharding_strategy(), kNoShard);
  config.use_distributed_optimizer = true;
  EXPECT_EQ(config.sharding_strategy(), kShardOptim);
  config.data_parallel_sharding_strategy = kNoShard;
  EXPECT_THAT(error_of([&] { config.check_combination(); }),
              HasSubstr("data_parallel_sharding_strategy = 'no_shard' but use_distributed_optimizer = true"));
  config.use_distributed_optimizer = false;
  config.data_parallel_sharding_strategy = kShardOptimGrads;
  config.apply_sharding_strategy();
  EXPECT_TRUE(config.use_distributed_optimizer);
  config.data_parallel_sharding_strategy = kShardOptimGradsParams;
  config.use_distributed_optimizer = false;
  config.validate();
  config.apply_sharding_strategy();
  EXPECT_TRUE(config.use_distributed_optimizer);
  EXPECT_TRUE(config.shards_grads() && config.shards_params());
  config.data_parallel_sharding_strategy = "zero2";
  EXPECT_THAT(error_of([&] { config.validate(); }), HasSubstr("'zero2' is not one of"));
}

// Under "optim_grads" each non-last micro-batch's backward ends with a round of reduce-scatters. A rank
// that never marks its last micro-batch (all under no_sync(), then finish_grad_sync(), which "optim" takes
// alike) has reduced it at the end of its backward, as a rank that marks it reduces it in its backward:
// finish_grad_sync() must launch no further round, which the other rank would never join (it hung in a
// reduce-scatter until the group's timeout). Both ranks' shards are "optim"'s (exact: small integers).
TEST(GradBufferShardedGrads, ARankThatNeverMarksItsLastMicroBatchSyncsWithOnesThatDo) {
  test::run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    const auto want = shards_after(mesh, kShardOptim, 3);
    const auto got = shards_after(mesh, kShardOptimGrads, 3, nullptr, /*marks_last=*/mesh.rank() == 0);
    ASSERT_EQ(got.size(), want.size());
    for (size_t b = 0; b < want.size(); ++b) EXPECT_TRUE(at::equal(got[b], want[b])) << "bucket " << b;
  });
}

// A rank with one more backward in a step (two backward calls in one micro-batch, where the other rank
// sums the losses first) runs one more round of reduce-scatters under "optim_grads": with
// MESHDDP_DEBUG_SYNC each rank names the disagreement (the extra round's first launch against the
// other's end of the step), instead of one rank hanging in a collective the other never launches.
TEST(GradBufferShardedGrads, DebugSyncNamesARankWithOneMoreBackwardInAStep) {
  override_switch_for_testing(Switch::kDebugSync, true);
  std::vector<std::string> errors(2);
  test::run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    auto params = make_params();
    GradBuffer buffer(params, mesh["dp"], strategy(kShardOptimGrads));
    errors[mesh.rank()] = error_of([&] {
      buffer.set_is_last_microbatch(false);
      backward(params, mesh.rank(), 0);
      if (mesh.rank() == 0) backward(params, mesh.rank(), 0);  // rank 1 summed the two losses
      buffer.set_is_last_microbatch(true);
      backward(params, mesh.rank(), 1);
      buffer.finish_grad_sync();
    });
  });
  override_switch_for_testing(Switch::kDebugSync, std::nullopt);
  for (const std::string& msg : errors) {
    EXPECT_THAT(msg, HasSubstr("the bucket collectives diverge across ranks"));
    EXPECT_THAT(msg, HasSubstr("micro-batch reduction 2 of the step"));
    EXPECT_THAT(msg, HasSubstr("end of step after 2 micro-batch reduction(s)"));
  }
}

// find_unused_parameters under no_sync(): each forward marks the params its outputs cannot reach. Under
// "optim_grads" that mark started the step's sync in forward, so a second forward before the first
// backward (forward, forward, backward, backward, which "optim" takes) was refused as "a new step began
// before finish_grad_sync()". Marking happens on the last micro-batch only, as under "optim"; the flush at
// the end of each non-last backward launches every bucket anyway. Shards equal "optim"'s.
TEST(GradBufferShardedGrads, TwoForwardsBeforeTheirBackwardsWithUnusedParamsAccumulateAsOptim) {
  test::run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    std::vector<std::vector<at::Tensor>> shards;
    for (const char* name : {kShardOptim, kShardOptimGrads}) {
      auto params = make_params();
      GradBuffer buffer(params, mesh["dp"], strategy(name));
      const auto loss_without = [&](int64_t unused, int scale) {
        at::Tensor loss;
        for (int64_t i = 0; i < kParams; ++i) {
          if (i == unused) continue;
          auto term = (params[i].param * static_cast<double>(scale * (i + 1) + mesh.rank())).sum();
          loss = loss.defined() ? loss + term : term;
        }
        buffer.mark_unreachable_params_ready({loss});  // what find_unused_parameters does after forward
        return loss;
      };
      buffer.set_is_last_microbatch(false);
      const at::Tensor first = loss_without(5, 1);
      buffer.check_no_sync_pending("DistributedDataParallel::forward");  // the second forward's check
      const at::Tensor second = loss_without(9, 2);
      torch::autograd::backward({first});
      torch::autograd::backward({second});
      buffer.set_is_last_microbatch(true);
      torch::autograd::backward({loss_without(0, 3)});
      buffer.finish_grad_sync();
      auto& mine = shards.emplace_back();
      for (int64_t b = 0; b < static_cast<int64_t>(buffer.layout().buckets.size()); ++b) {
        mine.push_back(buffer.bucket_shard(b).clone());
      }
    }
    for (size_t b = 0; b < shards[0].size(); ++b) EXPECT_TRUE(at::equal(shards[1][b], shards[0][b])) << "bucket " << b;
  });
}
