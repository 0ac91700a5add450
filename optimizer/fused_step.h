// The fused optimizer pass over one flat fp32 shard, and the fused gradient statistics pass: plain
// C++ entry points over at::Tensor that run the functors of fused_step_math.h on the tensors'
// device: CPU (always; Thrust's CPP system, split across ATen's threads) or CUDA (built with the
// CUDA toolkit, MESHDDP_WITH_CUDA; asynchronous on the current stream). No CUDA types here.
//
// One AdamW pass reads grad, exp_avg, exp_avg_sq and master once and writes exp_avg, exp_avg_sq,
// master and (for bf16 params, or an fp32 param buffer apart from the master) the param once; the
// gradient scale of clipping is applied on the fly (the grad itself is not written). Arithmetic and
// its bounds against ATen: Note [Fused step arithmetic] in fused_step_math.h.
#pragma once

#include "fused_step_math.h"

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace meshddp {

// True when the fused kernels can run on tensors of this device in this build.
bool fused_kernels_available(const c10::Device& device);

// The fp32 scalars of step `step` (1 for the first) as ATen's foreach ops round them.
fused::AdamWScalars adamw_scalars(double lr, double weight_decay, double beta1, double beta2, double eps, int64_t step,
                                  double grad_scale = 1.0);
fused::SgdScalars sgd_scalars(double lr, double weight_decay, double momentum, double grad_scale = 1.0);

// In place over contiguous 1-D tensors of equal length on one device: grad, exp_avg, exp_avg_sq
// and master fp32; `param` undefined or sharing master's memory (master is the param), else fp32 or
// bf16. Throws naming the tensor when one does not fit.
void fused_adamw_step(const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                      const at::Tensor& master, const at::Tensor& param, const fused::AdamWScalars& scalars);
// momentum_buffer undefined when scalars.momentum == 0.
void fused_sgd_step(const at::Tensor& grad, const at::Tensor& momentum_buffer, const at::Tensor& master,
                    const at::Tensor& param, const fused::SgdScalars& scalars);

// Adds [sum of squares of the finite elements of `grad` (fp64 accumulation), count of its NaN/Inf
// elements] into `out`, a 2-element fp64 tensor on grad's device. No host sync on CUDA. On CPU the
// sum is over fixed chunks of kStatsChunk elements added in order: deterministic at any thread count.
void fused_grad_stats(const at::Tensor& grad, const at::Tensor& out);
constexpr int64_t kStatsChunk = 1 << 16;

}  // namespace meshddp
