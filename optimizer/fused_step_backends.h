// The two builds of the fused kernels (fused_step_math.h): Thrust's CPP system on a range of
// indices (fused_step_cpu.cpp, always built) and CUDA (fused_step.cu, built with MESHDDP_WITH_CUDA).
// Private to optimizer/: callers use fused_step.h. Torch-free, so nvcc never parses ATen.
#pragma once

#include "fused_step_math.h"

#include <cstddef>
#include <cstdint>

namespace meshddp::fused {

// Elements [begin, end) on the calling thread.
void adamw_cpu(const AdamWStep& f, int64_t begin, int64_t end);
void sgd_cpu(const SgdStep& f, int64_t begin, int64_t end);
GradStats grad_stats_cpu(const float* grad, int64_t begin, int64_t end);

#ifdef MESHDDP_WITH_CUDA
// Asynchronous on `stream` (a cudaStream_t).
void adamw_cuda(const AdamWStep& f, int64_t n, void* stream);
void sgd_cuda(const SgdStep& f, int64_t n, void* stream);
// CUB DeviceReduce::TransformReduce into out[0] (device memory). Call with temp == nullptr to get
// the scratch size in temp_bytes, then again with that much scratch.
void grad_stats_cuda(const float* grad, int64_t n, GradStats* out, void* temp, size_t& temp_bytes, void* stream);
#endif

}  // namespace meshddp::fused
