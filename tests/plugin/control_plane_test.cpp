// meshddp on groups with no backend for CPU tensors (what torch's init_process_group("nccl") makes,
// seen from the CPU): ensure_cpu_backend gives them a Gloo backend from their own store (Note
// [Control plane on any group], mesh/process_group_factory.h), so the agreement checks, ZeRO-1
// training with its non-finite report, and checkpoints work on them. Here a group whose only backend
// is a stand-in registered for CUDA tensors (it runs nothing) is the NCCL-only group;
// tests/python/test_groups.py does the same through torch's init_process_group("cuda:gloo").
#include "grad_buffer/grad_buffer.h"
#include "mesh/collectives.h"
#include "mesh/process_group_factory.h"
#include "tests/support/rank_threads.h"
#include "tests/support/temp_dir.h"
#include "tests/support/zero_training.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <limits>

// The optimizer-only checkpoint (DistributedOptimizer::save_checkpoint / load_checkpoint), deprecated
// for users, is still read, written and tested here.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

using namespace meshddp;
using namespace meshddp::test;
using ::testing::HasSubstr;

namespace {

// Stands for NCCL: a backend for CUDA tensors only, which this CPU test never calls.
class CudaOnlyBackend : public c10d::Backend {
 public:
  using c10d::Backend::Backend;
  const std::string getBackendName() const override { return "cuda-only stand-in"; }
};

// A group over `store` whose only backend serves CUDA tensors: it takes no CPU tensors.
c10::intrusive_ptr<c10d::ProcessGroup> group_without_cpu_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                                 int size, const std::string& name) {
  auto group = c10::make_intrusive<c10d::ProcessGroup>(c10::make_intrusive<c10d::PrefixStore>(name, store), rank, size);
  group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::CUSTOM,
                    c10::make_intrusive<CudaOnlyBackend>(rank, size));
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
  group->setGroupName(name);
  return group;
}

bool has_cpu_backend(const c10d::ProcessGroup& group) {
  for (const auto& device : group.getDeviceTypes()) {
    if (device.type() == c10::DeviceType::CPU) return true;
  }
  return false;
}

}  // namespace

TEST(ControlPlane, EnsureCpuBackendLetsAGroupWithoutOneGatherStrings) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  run_ranks(2, [&](int rank) {
    auto group = group_without_cpu_backend(store, rank, 2, "nccl-like");
    ASSERT_FALSE(has_cpu_backend(*group));
    EXPECT_THROW(all_gather_strings(*group, "x", "the test"), c10::Error);  // no backend for CPU tensors
    ensure_cpu_backend(*group, "the test");
    EXPECT_TRUE(has_cpu_backend(*group));
    ensure_cpu_backend(*group, "the test");  // a no-op now: no second rendezvous
    EXPECT_EQ(all_gather_strings(*group, "rank " + std::to_string(rank), "the test"),
              (std::vector<std::string>{"rank 0", "rank 1"}));
  });
}

// The whole ZeRO-1 path on a mesh built from such groups: DDP construction (settings and model
// checks, broadcast), 4 steps of training equal to the golden, a checkpoint saved and loaded into a
// fresh model, every rank bit-identical.
TEST(ControlPlane, ZeroOneTrainsAndCheckpointsOnGroupsWithoutACpuBackend) {
  ZeroScenario s;
  s.world = 2;
  s.steps = 4;
  const auto golden = train_zero_golden(s);
  const std::string dir = fresh_dir("control-plane");
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::vector<torch::Tensor>> trained(2), loaded(2);
  run_ranks(2, [&](int rank) {
    DeviceMesh mesh = DeviceMesh::from_groups({2}, {"dp"}, rank, {group_without_cpu_backend(store, rank, 2, "dp")});
    ZeroRank zero(mesh, s, kZeroSeed);
    zero.train(0, s.steps);
    zero.opt->save_checkpoint(dir);
    trained[rank] = zero.params();
    ZeroRank fresh(mesh, s, kZeroSeed + 1);
    fresh.opt->load_checkpoint(dir);
    loaded[rank] = fresh.params();
  });
  // distributed_optimizer_test's fp32 tolerance (kFp32Tol): a DP mean of 2 shards vs one process's
  // mean over the whole batch differ by fp32 rounding only.
  EXPECT_LE(max_abs_diff(trained[0], golden), 2e-6);
  EXPECT_EQ(max_abs_diff(trained[0], trained[1]), 0.0);
  EXPECT_EQ(max_abs_diff(loaded[0], trained[0]), 0.0);
  EXPECT_EQ(max_abs_diff(loaded[1], trained[1]), 0.0);
}

// check_for_nan_in_grad's report (an all-reduce of the count, then an all-gather of the lines)
// reaches every rank on such a group, naming the param and the rank.
TEST(ControlPlane, NonFiniteReportNamesTheParamOnGroupsWithoutACpuBackend) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(2);
  run_ranks(2, [&](int rank) {
    DeviceMesh mesh = DeviceMesh::from_groups({2}, {"dp"}, rank, {group_without_cpu_backend(store, rank, 2, "dp")});
    std::vector<NamedParam> params{{"a.weight", at::zeros({4}).requires_grad_(true)},
                                   {"b.weight", at::zeros({3}).requires_grad_(true)}};
    GradBufferConfig config;
    config.check_for_nan_in_grad = true;
    GradBuffer buffer(params, mesh["dp"], config);
    at::Tensor weight = at::ones({3});
    if (rank == 1) weight[2] = std::numeric_limits<double>::quiet_NaN();
    torch::autograd::backward({params[0].param.sum() + (params[1].param * weight).sum()});
    try {
      buffer.finish_grad_sync();
    } catch (const c10::Error& e) {
      errors[rank] = e.what_without_backtrace();
    }
  });
  for (const auto& error : errors) {
    EXPECT_THAT(error, HasSubstr("rank 1 (DP rank 1): parameter 'b.weight' has 1 NaN/Inf gradient value(s) of 3"));
  }
}
