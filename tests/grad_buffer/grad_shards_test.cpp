// GradBuffer under the "optim_grads" sharding strategy (ZeRO-2; Note [Sharded gradients] in
// grad_buffer/grad_shards.cpp), on real Gloo groups (ranks as threads): a rank's gradient storage is its
// shards plus the buckets in flight, the shards equal "optim"'s exactly (with accumulation too), and the
// strategy's settings and refusals are named.
#include "grad_buffer/grad_buffer.h"
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
std::vector<at::Tensor> shards_after(DeviceMesh& mesh, const char* name, int micro_batches, int64_t* bytes = nullptr) {
  auto params = make_params();
  GradBuffer buffer(params, mesh["dp"], strategy(name));
  for (int m = 0; m < micro_batches; ++m) {
    buffer.set_is_last_microbatch(m == micro_batches - 1);
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
