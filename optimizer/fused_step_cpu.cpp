// The CPU build of the fused kernels: the functors of fused_step_math.h run by Thrust's CPP system
// over a range of indices (fused_step.cpp splits the shard across ATen's threads). Compiled with
// THRUST_DEVICE_SYSTEM=CPP and -ffp-contract=off (optimizer/CMakeLists.txt); without Thrust headers
// (MESHDDP_NO_THRUST: no CUDA toolkit at all) the same functors run in a plain loop.
#include "optimizer/fused_step_backends.h"

#ifndef MESHDDP_NO_THRUST
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/system/cpp/execution_policy.h>
#include <thrust/transform_reduce.h>
#endif

namespace meshddp::fused {
namespace {

template <class F>
void for_each_index(const F& f, int64_t begin, int64_t end) {
#ifndef MESHDDP_NO_THRUST
  thrust::for_each(thrust::cpp::par, thrust::counting_iterator<int64_t>(begin), thrust::counting_iterator<int64_t>(end),
                   f);
#else
  for (int64_t i = begin; i < end; ++i) f(i);
#endif
}

}  // namespace

void adamw_cpu(const AdamWStep& f, int64_t begin, int64_t end) { for_each_index(f, begin, end); }

void sgd_cpu(const SgdStep& f, int64_t begin, int64_t end) { for_each_index(f, begin, end); }

GradStats grad_stats_cpu(const float* grad, int64_t begin, int64_t end) {
#ifndef MESHDDP_NO_THRUST
  return thrust::transform_reduce(thrust::cpp::par, thrust::counting_iterator<int64_t>(begin),
                                  thrust::counting_iterator<int64_t>(end), SquareOrCount{grad}, GradStats{0.0, 0.0},
                                  AddStats{});
#else
  GradStats total{0.0, 0.0};
  for (int64_t i = begin; i < end; ++i) total = AddStats{}(total, SquareOrCount{grad}(i));
  return total;
#endif
}

}  // namespace meshddp::fused
