// The non-finite count by piece (grad_buffer/nonfinite_count.h): the pieces of a bucket, computed by
// hand; the counts against ATen's isfinite for every gradient dtype, at odd sizes, with NaN, +-Inf,
// the largest finite values (whose sum overflows), subnormals and empty pieces; on CUDA, the same
// counts as on CPU (skipped without a GPU: scripts/gpu_check.sh runs it there); and through a
// GradBuffer, a NaN in a param bigger than one piece is attributed to that param.
#include "grad_buffer/nonfinite_count.h"

#include "grad_buffer/grad_buffer.h"
#include "tests/support/param_specs.h"
#include "tests/support/rank_threads.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <limits>

using namespace meshddp;

namespace {

#define SKIP_WITHOUT_CUDA_KERNELS()                                           \
  if (!kCudaKernelsBuilt) GTEST_SKIP() << "a build without the CUDA kernels"; \
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device: scripts/gpu_check.sh runs this on a GPU"

#ifdef MESHDDP_WITH_CUDA
constexpr bool kCudaKernelsBuilt = true;
#else
constexpr bool kCudaKernelsBuilt = false;
#endif

// ATen's count of each piece, on the host.
std::vector<int64_t> aten_counts(const at::Tensor& data, const std::vector<int64_t>& offsets) {
  std::vector<int64_t> counts;
  for (size_t p = 0; p + 1 < offsets.size(); ++p) {
    counts.push_back(at::isfinite(data.slice(0, offsets[p], offsets[p + 1])).logical_not().sum().item<int64_t>());
  }
  return counts;
}

std::vector<int64_t> to_vector(const at::Tensor& counts) {
  const at::Tensor host = counts.cpu().contiguous();
  return std::vector<int64_t>(host.const_data_ptr<int64_t>(), host.const_data_ptr<int64_t>() + host.numel());
}

// n random values of `dtype` with NaN, +Inf, -Inf, the largest finite value and the smallest
// subnormal planted at pseudo-random places (every kind at least once when n >= 5).
at::Tensor planted(int64_t n, at::ScalarType dtype, uint64_t seed) {
  at::Tensor data = at::randn({n}, at::TensorOptions().dtype(at::kDouble)).to(dtype);
  const double specials[] = {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
                             -std::numeric_limits<double>::infinity()};
  uint64_t state = seed;
  auto next = [&] {
    return static_cast<int64_t>((state = state * 6364136223846793005ull + 1442695040888963407ull) >> 33);
  };
  for (int64_t k = 0; n > 0 && k < 1 + n / 97; ++k) data[next() % n] = specials[k % 3];
  if (n >= 5) {
    const auto info_max = dtype == at::kDouble     ? std::numeric_limits<double>::max()
                          : dtype == at::kFloat    ? std::numeric_limits<float>::max()
                          : dtype == at::kBFloat16 ? 3.3895313892515355e38
                                                   : 65504.0;
    data[n - 1] = info_max;
    data[n - 2] = info_max;
    data[n / 2] = std::numeric_limits<double>::quiet_NaN();
    data[1] = std::numeric_limits<double>::infinity();
    data[0] = dtype == at::kHalf ? 5.960464477539063e-08 : dtype == at::kBFloat16 ? 9.183549615799121e-41 : 1e-40;
  }
  return data;
}

// Pieces of sizes 0, 1, 7, 64 and the rest of n.
std::vector<int64_t> uneven_offsets(int64_t n) {
  std::vector<int64_t> offsets{0};
  for (int64_t size : {0, 1, 7, 64}) offsets.push_back(std::min(n, offsets.back() + size));
  offsets.push_back(n);
  return offsets;
}

void compare_with_aten(const at::Device& device) {
  for (at::ScalarType dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    for (int64_t n : {0, 1, 7, 33, 1000, 65537, 100003}) {
      const at::Tensor data = planted(n, dtype, static_cast<uint64_t>(n) * 31 + static_cast<uint64_t>(dtype));
      const std::vector<int64_t> offsets = uneven_offsets(n);
      const at::Tensor counts =
          count_nonfinite_pieces(data.to(device), at::tensor(offsets, at::TensorOptions().dtype(at::kLong)).to(device));
      EXPECT_EQ(counts.device(), device);
      EXPECT_EQ(to_vector(counts), aten_counts(data, offsets)) << dtype << " n=" << n;
    }
    // All finite but for the largest values: the CPU's sum overflows to Inf and the exact count says 0.
    const at::Tensor large = at::full({1000}, dtype == at::kHalf ? 65504.0 : 3e38, at::TensorOptions().dtype(dtype));
    const std::vector<int64_t> offsets{0, 500, 1000};
    const at::Tensor counts = count_nonfinite_pieces(large.to(device), at::tensor(offsets, at::kLong).to(device));
    EXPECT_EQ(to_vector(counts), (std::vector<int64_t>{0, 0})) << dtype;
  }
}

}  // namespace

// Two 100-element params and one of 10, padded for DP 2 (params start at multiples of 64, the bucket
// ends at a multiple of 128); pieces of at most 64 elements. Placement is reverse registration order.
TEST(NonfinitePieces, CoverTheBucketInPiecesOfAtMostMaxPieceAttributingPaddingToThePrecedingParam) {
  const BucketLayout layout =
      assign_buckets(test::fp32_param_specs({100, 10, 100}), LayoutConfig{size_t{1} << 30, true, 2});
  ASSERT_EQ(layout.buckets.size(), 1u);
  // p2 at 0 (100, padded to 128), p1 at 128 (10, padded to 192), p0 at 192 (100): end 292 -> 384.
  ASSERT_EQ(layout.slots[1].offset, 128);
  ASSERT_EQ(layout.slots[0].offset, 192);
  ASSERT_EQ(layout.buckets[0].numel(), 384);
  const NonfinitePieces pieces = nonfinite_pieces(layout, 0, 64);
  EXPECT_EQ(pieces.offsets, (std::vector<int64_t>{0, 64, 128, 192, 256, 320, 384}));
  EXPECT_EQ(pieces.param, (std::vector<int64_t>{2, 2, 1, 0, 0, 0}));
  // Unpadded, one piece per param when they are small; a zero-element param gets no piece.
  const BucketLayout dense = assign_buckets(test::fp32_param_specs({3, 0, 5}), LayoutConfig{size_t{1} << 30, false, 1});
  const NonfinitePieces whole = nonfinite_pieces(dense, 0);
  EXPECT_EQ(whole.offsets, (std::vector<int64_t>{0, 5, 8}));
  EXPECT_EQ(whole.param, (std::vector<int64_t>{2, 0}));
  EXPECT_THROW(nonfinite_pieces(dense, 1), c10::Error);
  EXPECT_THROW(nonfinite_pieces(dense, 0, 0), c10::Error);
}

TEST(NonfiniteCount, MatchesAtenIsfiniteForEveryGradDtypeOnCpu) { compare_with_aten(at::kCPU); }

// A dtype without a bit-test functor (complex here) is counted by ATen's isfinite per piece.
TEST(NonfiniteCount, OtherDtypesAreCountedByAten) {
  at::Tensor data = at::zeros({10}, at::kComplexFloat);
  data[1] = c10::complex<float>(std::numeric_limits<float>::quiet_NaN(), 0);
  data[7] = c10::complex<float>(0, std::numeric_limits<float>::infinity());
  EXPECT_EQ(to_vector(count_nonfinite_pieces(data, at::tensor({0, 5, 10}, at::kLong))), (std::vector<int64_t>{1, 1}));
}

TEST(NonfiniteCount, RefusesOffsetsThatDoNotCoverTheData) {
  const at::Tensor data = at::zeros({10});
  EXPECT_THROW(count_nonfinite_pieces(data, at::tensor({0, 5}, at::kLong)), c10::Error);         // stops short
  EXPECT_THROW(count_nonfinite_pieces(data, at::tensor({0, 6, 5, 10}, at::kLong)), c10::Error);  // decreases
  EXPECT_THROW(count_nonfinite_pieces(data, at::tensor({0, 10}, at::kInt)), c10::Error);         // not int64
}

TEST(NonfiniteCountCuda, MatchesAtenIsfiniteForEveryGradDtypeOnCuda) {
  SKIP_WITHOUT_CUDA_KERNELS();
  compare_with_aten(at::Device(at::kCUDA, 0));
}

namespace {

// Through the buffer: a bucket holding a 70000-element param (two pieces) and a small one; a NaN at
// element 66000 of the big one, two Infs in the small one. The ZeRO-1 totals and the counts by param;
// then check_for_nan_in_grad's error on the same gradients.
void attribute_through_grad_buffer(const at::Device& device) {
  test::run_on_mesh({1}, {"dp"}, [&](DeviceMesh& mesh) {
    std::vector<NamedParam> params{{"big", at::zeros({70000}, device).requires_grad_(true)},
                                   {"small", at::zeros({9}, device).requires_grad_(true)}};
    GradBufferConfig config;
    config.use_distributed_optimizer = true;
    GradBuffer buffer(params, mesh["dp"], config);
    ASSERT_EQ(buffer.layout().buckets.size(), 1u);
    buffer.zero_grad_buffer();
    at::Tensor big = at::ones({70000});
    big[66000] = std::numeric_limits<double>::quiet_NaN();
    at::Tensor small = at::ones({9});
    small[2] = std::numeric_limits<double>::infinity();
    small[8] = -std::numeric_limits<double>::infinity();
    torch::autograd::backward({(params[0].param * big.to(device)).sum() + (params[1].param * small.to(device)).sum()});
    buffer.finish_grad_sync();
    EXPECT_EQ(buffer.local_nonfinite_counts().device(), device);
    EXPECT_EQ(to_vector(buffer.local_nonfinite_counts()), (std::vector<int64_t>{3}));
    EXPECT_EQ(buffer.local_nonfinite_counts_by_param(), (std::vector<int64_t>{1, 2}));
    // The next step is clean: the counts are this step's.
    buffer.zero_grad_buffer();
    torch::autograd::backward({params[0].param.sum() + params[1].param.sum()});
    buffer.finish_grad_sync();
    EXPECT_EQ(buffer.local_nonfinite_counts_by_param(), (std::vector<int64_t>{0, 0}));

    // check_for_nan_in_grad (no ZeRO) on the same gradients: finish_grad_sync() throws naming both.
    std::vector<NamedParam> again{{"big", at::zeros({70000}, device).requires_grad_(true)},
                                  {"small", at::zeros({9}, device).requires_grad_(true)}};
    GradBufferConfig check;
    check.check_for_nan_in_grad = true;
    GradBuffer checked(again, mesh["dp"], check);
    checked.zero_grad_buffer();
    torch::autograd::backward({(again[0].param * big.to(device)).sum() + (again[1].param * small.to(device)).sum()});
    std::string error;
    try {
      checked.finish_grad_sync();
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    }
    EXPECT_THAT(error, ::testing::HasSubstr("parameter 'big' has 1 NaN/Inf gradient value(s) of 70000"));
    EXPECT_THAT(error, ::testing::HasSubstr("parameter 'small' has 2 NaN/Inf gradient value(s) of 9"));
  });
}

}  // namespace

TEST(NonfiniteCount, GradBufferAttributesEachPiecesCountToItsParam) { attribute_through_grad_buffer(at::kCPU); }

TEST(NonfiniteCountCuda, GradBufferAttributesEachPiecesCountToItsParamOnCuda) {
  SKIP_WITHOUT_CUDA_KERNELS();
  attribute_through_grad_buffer(at::Device(at::kCUDA, 0));
}
