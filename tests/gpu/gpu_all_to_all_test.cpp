// Expert parallelism's token exchange with CUDA tensors. On 4 ranks as threads sharing the one GPU over
// Gloo (NCCL cannot put two ranks on one GPU), some splits 0: tp::all_to_all forward and backward
// against a local golden (every rank's rows are a known function of (source, destination, row), so each
// rank builds what it must receive and the gradient each of its rows must get back), as
// tests/tp/expert_parallel_test.cpp does on CPU. At world size 1 on NCCL: the collective under it
// (mesh/all_to_all.h; tp::all_to_all skips it at one rank), rows moving from the input into a separate
// output on NCCL's stream, and the count exchange. The exchange moves bits: exact. Without a CUDA
// device every test skips, saying so.
#include "mesh/all_to_all.h"
#include "mesh/device_mesh.h"
#include "tests/support/rank_threads.h"
#include "tp/expert_parallel.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <cstdlib>

using namespace meshddp;
using namespace meshddp::test;

namespace {

constexpr int64_t kWidth = 3;

#define SKIP_WITHOUT_GPU()                                                   \
  if (!torch::cuda::is_available())                                          \
  GTEST_SKIP() << "no CUDA device on this machine: the GPU path is checked " \
                  "by scripts/gpu_check.sh on a GPU machine"

int64_t rows_between(int64_t src, int64_t dst) { return (src + 2 * dst + 1) % 4; }  // some are 0

// The rows rank `src` sends to rank `dst`: [rows_between, kWidth], each a distinct value, on the GPU.
torch::Tensor rows_from(int64_t src, int64_t dst) {
  const int64_t n = rows_between(src, dst);
  return (torch::arange(n * kWidth, torch::kFloat).view({n, kWidth}) + 100 * src + 1000 * dst).cuda();
}

// The weights rank `dst` applies to what it received (so the gradient of each received row is known).
torch::Tensor weights_on(int64_t dst, int64_t rows) {
  return (torch::arange(rows * kWidth, torch::kFloat).view({rows, kWidth}) * 0.5 + 7 * dst).cuda();
}

// The exchange on this rank of a group of `ranks`: the received rows and the sent rows' gradients.
void expect_exchange_matches_local_golden(c10d::ProcessGroup* group, int64_t me, int64_t ranks) {
  std::vector<torch::Tensor> sent, expected;
  std::vector<int64_t> input_splits, output_splits;
  for (int64_t r = 0; r < ranks; ++r) {
    sent.push_back(rows_from(me, r));
    input_splits.push_back(rows_between(me, r));
    expected.push_back(rows_from(r, me));
    output_splits.push_back(rows_between(r, me));
  }
  const auto x = torch::cat(sent).requires_grad_();
  const auto out = tp::all_to_all(x, output_splits, input_splits, group);
  ASSERT_TRUE(out.is_cuda()) << "rank " << me;
  EXPECT_TRUE(torch::equal(out, torch::cat(expected)))
      << "rank " << me << ": " << out << " vs " << torch::cat(expected);
  (out * weights_on(me, out.size(0))).sum().backward();
  std::vector<torch::Tensor> grads;  // row i of what this rank sent to rank r sits on r after the rows of ranks < me
  for (int64_t r = 0; r < ranks; ++r) {
    int64_t before = 0, total = 0;
    for (int64_t s = 0; s < ranks; ++s) {
      before += s < me ? rows_between(s, r) : 0;
      total += rows_between(s, r);
    }
    grads.push_back(weights_on(r, total).narrow(0, before, rows_between(me, r)));
  }
  EXPECT_TRUE(torch::equal(x.grad(), torch::cat(grads))) << "rank " << me;
}

}  // namespace

// At one rank tp::all_to_all is the identity (no collective); the collective under it
// (mesh/all_to_all.h) runs on NCCL: rows into a separate output, and the count exchange.
TEST(GpuExpertTokenExchange, AllToAllRowsWithNcclAtWorldSizeOneMovesTheRowsIntoTheOutput) {
  SKIP_WITHOUT_GPU();
  setenv("LOCAL_RANK", "0", 1);
  MeshOptions options;
  options.device_type = c10::DeviceType::CUDA;
  options.timeout = kTestTimeout;
  DeviceMesh mesh = DeviceMesh::from_store(c10::make_intrusive<c10d::HashStore>(), 0, 1, {1}, {"ep"}, options);
  c10d::ProcessGroup& group = *mesh["ep"];
  ASSERT_EQ(group.getBackendType(), c10d::ProcessGroup::BackendType::NCCL);
  const torch::Tensor input = (torch::arange(5 * kWidth, torch::kFloat).view({5, kWidth}) + 100).cuda();
  const torch::Tensor output = torch::full({5, kWidth}, -1.0).cuda();
  wait_collective(all_to_all_rows(group, output, input, {5}, {5}, "the test's rows"), group, "all-to-all");
  EXPECT_TRUE(torch::equal(output, input)) << output;
  const torch::Tensor counts = torch::tensor({3, 0, 7}, torch::kLong).cuda();
  EXPECT_TRUE(torch::equal(all_to_all_counts(group, counts, "the test's counts"), counts));
}

TEST(GpuExpertTokenExchange, AllToAllOverGlooWithCudaTensorsOnFourRanksMatchesLocalGoldenForwardAndBackward) {
  SKIP_WITHOUT_GPU();
  run_on_mesh({4}, {"ep"},
              [](DeviceMesh& mesh) { expect_exchange_matches_local_golden(mesh["ep"].get(), mesh.rank(), 4); });
}
