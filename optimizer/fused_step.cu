// The CUDA build of the fused kernels: the functors of fused_step_math.h over every index, with
// Thrust (element-wise) and CUB DeviceReduce::TransformReduce (statistics), asynchronous on the
// caller's stream. Compiled with --fmad=false so the bits match the CPU build (Note [Fused step
// arithmetic]). Torch-free: fused_step.cpp passes the stream and allocates the scratch.
#include "optimizer/fused_step_backends.h"

#include <cub/device/device_reduce.cuh>
#include <cuda_runtime.h>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/system/cuda/execution_policy.h>

#include <stdexcept>
#include <string>

namespace meshddp::fused {
namespace {

void check(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) {
    throw std::runtime_error(std::string("meshddp fused optimizer kernels: ") + what +
                             " failed: " + cudaGetErrorString(rc));
  }
}

template <class F>
void for_each_index(const F& f, int64_t n, void* stream) {
  if (n == 0) return;
  thrust::for_each_n(thrust::cuda::par_nosync.on(static_cast<cudaStream_t>(stream)),
                     thrust::counting_iterator<int64_t>(0), n, f);
  check(cudaGetLastError(), "the element-wise kernel launch");
}

}  // namespace

void adamw_cuda(const AdamWStep& f, int64_t n, void* stream) { for_each_index(f, n, stream); }

void sgd_cuda(const SgdStep& f, int64_t n, void* stream) { for_each_index(f, n, stream); }

void grad_stats_cuda(const float* grad, int64_t n, GradStats* out, void* temp, size_t& temp_bytes, void* stream) {
  check(cub::DeviceReduce::TransformReduce(temp, temp_bytes, thrust::counting_iterator<int64_t>(0), out, n, AddStats{},
                                           SquareOrCount{grad}, GradStats{0.0, 0.0}, static_cast<cudaStream_t>(stream)),
        "cub::DeviceReduce::TransformReduce");
}

}  // namespace meshddp::fused
