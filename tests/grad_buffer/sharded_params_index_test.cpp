// How the gather-on-use dispatch mode of "optim_grads_params" (ZeRO-3) finds a tensor's bucket on
// another thread (Note [Finding a bucket's storage without a lock], grad_buffer/sharded_params.cpp): a
// thread that inherits the mode the way the autograd engine's device threads do (the ThreadLocalState
// of the thread that turned it on, none of its thread_local variables) finds the buckets of every
// live ShardedParams, including one built after its own last lookup.
#include "grad_buffer/grad_buffer.h"
#include "tests/support/error_of.h"
#include "tests/support/rank_threads.h"

#include <ATen/ATen.h>
#include <ATen/ThreadLocalState.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <future>
#include <memory>
#include <thread>

using namespace meshddp;
using meshddp::test::error_of;
using ::testing::HasSubstr;

namespace {

std::vector<NamedParam> make_params(const std::string& prefix) {
  std::vector<NamedParam> params;
  for (int k = 0; k < 2; ++k) {
    params.push_back({prefix + std::to_string(k) + ".weight", at::full({4, 4}, 0.5 + k).requires_grad_(true)});
  }
  return params;
}

std::unique_ptr<GradBuffer> make_buffer(std::vector<NamedParam>& params, DeviceMesh& mesh) {
  GradBufferConfig config;
  config.data_parallel_sharding_strategy = kShardOptimGradsParams;
  config.bucket_bytes = 4 * 4 * 4;  // one param a bucket
  return std::make_unique<GradBuffer>(params, mesh["dp"], config);
}

}  // namespace

// The helper thread looks up a plain tensor (its view of the live buckets: the first buffer's only),
// then the main thread builds a second buffer. The helper's read of a released param of each, outside
// a forward, must be refused naming it: a lookup that missed the second buffer would let the read run
// on a storage with no bytes.
TEST(ShardedParamsIndex, AThreadInheritingTheModeFindsABufferBuiltAfterItsLastLookup) {
  test::run_on_mesh({1}, {"dp"}, [](DeviceMesh& mesh) {
    auto first_params = make_params("first"), second_params = make_params("second");
    const auto first = make_buffer(first_params, mesh);
    // A scope turns the mode on in this thread, and leaves it on.
    (void)ShardedParams::UseScope(first->param_buffer()->sharded());
    const at::ThreadLocalState inherited;  // what the autograd engine hands its device threads

    std::promise<void> looked_up, second_built;
    std::string first_error, second_error;
    std::thread helper([&] {
      at::ThreadLocalStateGuard guard(inherited);
      (void)(at::ones({2}) + 1);  // a lookup before the second buffer exists
      looked_up.set_value();
      second_built.get_future().wait();
      first_error = error_of([&] { (void)first_params[1].param.sum(); });
      // Asked through the fallback's entry itself: a lookup that missed would let a real op read a
      // storage with no bytes (a crash, not a failure).
      second_error = error_of([&] { (void)ShardedParams::on_use(second_params[0].param, "aten::sum"); });
    });
    looked_up.get_future().wait();
    const auto second = make_buffer(second_params, mesh);
    second_built.set_value();
    helper.join();
    EXPECT_THAT(first_error, HasSubstr("aten::sum reads parameter 'first1.weight' (FSDP unit 'first1') outside a "
                                       "forward through DistributedDataParallel"));
    EXPECT_THAT(second_error, HasSubstr("aten::sum reads parameter 'second0.weight' (FSDP unit 'second0') outside a "
                                        "forward through DistributedDataParallel"));
  });
}
