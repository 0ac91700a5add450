// What DistributedDataParallel's construction does without staging copies: the broadcast from rank 0
// (large tensors in place, small ones in chunks; Note [Broadcast without staging copies],
// plugin/model_sync.cpp) and the lazily zeroed CPU buffers (grad_buffer/lazy_zeros.h), checked
// against rank 0's values and a one-process golden. bench/construction_bench.py measures the cost.
#include "grad_buffer/lazy_zeros.h"
#include "plugin/distributed_data_parallel.h"
#include "plugin/model_sync.h"
#include "tests/support/mlp.h"
#include "tests/support/rank_threads.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

using namespace meshddp;
using namespace meshddp::test;

namespace {

// Tensor `i`'s values on `rank`: distinct per tensor and per rank, exact in every dtype used.
torch::Tensor values_on(int64_t rank, int64_t i, at::IntArrayRef sizes, c10::ScalarType dtype) {
  const int64_t numel = c10::multiply_integers(sizes);
  return (torch::arange(numel, torch::kDouble).remainder(50) + 100 * i + 1000 * rank).to(dtype).view(sizes);
}

}  // namespace

// Thresholds made tiny: 400- and 384-byte tensors go in place (one transposed, so broadcast through a
// contiguous copy); five 120-byte floats fill two chunks of at most 512 bytes; a double, an int64 and a
// bf16 tensor each make a chunk of their own dtype. Every rank ends with rank 0's values, exactly.
TEST(BroadcastFromRankZero, InPlaceNonContiguousAndChunkedTensorsAllTakeRankZerosValues) {
  run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    const int64_t rank = mesh.rank();
    struct Case {
      std::vector<int64_t> sizes;
      c10::ScalarType dtype;
      bool transposed;
    };
    const std::vector<Case> cases = {{{10, 10}, torch::kFloat, false}, {{8, 12}, torch::kFloat, true},
                                     {{30}, torch::kFloat, false},     {{6, 5}, torch::kFloat, false},
                                     {{30}, torch::kFloat, false},     {{2, 15}, torch::kFloat, false},
                                     {{30}, torch::kFloat, false},     {{7}, torch::kDouble, false},
                                     {{3}, torch::kLong, false},       {{9}, torch::kBFloat16, false}};
    std::vector<NamedTensor> tensors;
    std::vector<torch::Tensor> bases;
    for (size_t i = 0; i < cases.size(); ++i) {
      const Case& c = cases[i];
      const auto index = static_cast<int64_t>(i);
      if (c.transposed) {
        bases.push_back(values_on(rank, index, {c.sizes[1], c.sizes[0]}, c.dtype));
        tensors.push_back({"t" + std::to_string(i), bases.back().t()});
        ASSERT_FALSE(tensors.back().tensor.is_contiguous());
      } else {
        bases.push_back(values_on(rank, index, c.sizes, c.dtype));
        tensors.push_back({"t" + std::to_string(i), bases.back()});
      }
    }
    broadcast_from_group_rank0(*mesh["dp"], tensors, "the test tensors", BroadcastChunking{256, 512});
    for (size_t i = 0; i < cases.size(); ++i) {
      const Case& c = cases[i];
      const auto index = static_cast<int64_t>(i);
      const torch::Tensor want = c.transposed ? values_on(0, index, {c.sizes[1], c.sizes[0]}, c.dtype).t()
                                              : values_on(0, index, c.sizes, c.dtype);
      EXPECT_TRUE(torch::equal(tensors[i].tensor, want)) << "rank " << rank << ", tensor " << i;
      EXPECT_EQ(tensors[i].tensor.data_ptr(), bases[i].data_ptr()) << "tensor " << i << " written in place";
    }
  });
}

// Large enough (over 1 MiB) to take the mmap path: zeros in every dtype, writable, and readable back.
TEST(LazyZeros, LargeCpuBuffersAreZeroAndWritable) {
  for (const auto dtype : {torch::kFloat, torch::kBFloat16, torch::kDouble}) {
    const int64_t numel = (int64_t{3} << 20) / 2 + 7;  // over 1 MiB in every dtype, not a page multiple
    torch::Tensor t = lazy_zeros(numel, torch::TensorOptions().dtype(dtype));
    ASSERT_EQ(t.numel(), numel);
    ASSERT_EQ(t.scalar_type(), dtype);
    EXPECT_EQ(t.count_nonzero().item<int64_t>(), 0) << dtype;
    t.narrow(0, numel - 3, 3).fill_(2);
    EXPECT_EQ(t.sum().item<double>(), 6.0) << dtype;
  }
}

// A model whose gradient buffer (1.2 MB) is lazily zeroed, and whose ranks start from different
// params: after construction every main grad is zero and every param is rank 0's; the first step,
// with no zero_grad_buffer() before it, gives the one-process gradient of rank 0's model on the whole
// batch (rtol 1e-5: the DP mean sums two half-batch gradients), plain DDP and ZeRO-1.
TEST(DistributedDataParallel, LazilyZeroedBuffersGiveTheGoldenFirstGradient) {
  for (const bool zero1 : {false, true}) {
    run_on_mesh({2}, {"dp"}, [zero1](DeviceMesh& mesh) {
      const int64_t rank = mesh.rank();
      Mlp golden = make_mlp(1, 512, 600, 4);
      Mlp model = make_mlp(1 + static_cast<uint64_t>(rank), 512, 600, 4);
      DdpConfig config;
      config.use_distributed_optimizer = zero1;
      DistributedDataParallel ddp(model.ptr(), mesh, "dp", config);
      for (const auto& p : model->named_parameters()) {
        EXPECT_TRUE(torch::equal(p.value(), golden->named_parameters()[p.key()])) << p.key() << " is rank 0's";
        EXPECT_EQ(ddp.main_grad(p.key()).count_nonzero().item<int64_t>(), 0) << p.key() << " main grad is zero";
      }
      const auto [x, y] = make_batch(3, 0, 8, 512, 4);
      torch::mse_loss(ddp.forward(shard_rows(x, rank, 2)), shard_rows(y, rank, 2)).backward();
      ddp.finish_grad_sync();
      torch::mse_loss(golden->forward(x), y).backward();
      for (const auto& p : golden->named_parameters()) {
        EXPECT_TRUE(torch::allclose(ddp.main_grad(p.key()), p.value().grad(), 1e-5, 1e-7))
            << (zero1 ? "ZeRO-1 " : "plain DDP ") << p.key() << ": max diff "
            << (ddp.main_grad(p.key()) - p.value().grad()).abs().max().item<double>();
      }
    });
  }
}
