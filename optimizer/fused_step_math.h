// The arithmetic of the fused optimizer pass, one element at a time: gradient scale (clipping),
// AdamW or SGD with momentum, and the cast of the new fp32 master into the param buffer. Plain
// structs of pointers and floats with a __host__ __device__ call operator, so the same source builds
// with nvcc for CUDA (fused_step.cu) and with the host compiler for Thrust's CPP system
// (fused_step_cpu.cpp), where CI tests it against ATen. No torch, no Thrust, no CUDA headers here.
//
// Note [Fused step arithmetic]
//   Each line below is one of today's ATen foreach ops (distributed_optimizer.cpp update_adamw /
//   update_sgd) in the same order, with the scalars rounded to fp32 as ATen does (opmath of float is
//   float). Where ATen's CPU kernels fuse a multiply-add (Vectorized fmadd in add with alpha; GCC
//   contracting addcmul's vector mul+add), the functor says fmaf explicitly; elsewhere it rounds
//   each operation. Both builds compile with contraction off (-ffp-contract=off, nvcc --fmad=false),
//   so the CPU and the CUDA build compute the same bits, and the CPU test covers the GPU arithmetic.
//   Versus ATen on CPU (measured in tests/optimizer/fused_step_test.cpp): exp_avg, exp_avg_sq and SGD
//   bit-identical; the AdamW master within 1 ulp, because ATen's CPU sqrt (MKL VML) is not correctly
//   rounded in ~17% of elements and ours is. Versus ATen on CUDA: a ulp bound, asserted by the same
//   test on a GPU (ATen's CUDA foreach kernels let nvcc contract freely).
#pragma once

#include "../grad_buffer/host_device.h"

#include <cstdint>
#include <cstring>
#include <math.h>  // fmaf, sqrtf: the same names on host and device

namespace meshddp::fused {

// Where the new master goes besides the master itself.
enum class ParamOut : int32_t {
  kNone = 0,  // the master is the param (fp32 params: a view of the param buffer)
  kFloat,     // an fp32 param buffer distinct from the master
  kBFloat16,  // round to nearest even, as c10::BFloat16; NaN stays NaN
};

// fp32 -> bf16 bits, round to nearest even (the same as c10::BFloat16's conversion).
MESHDDP_HD inline uint16_t float_to_bf16_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

MESHDDP_HD inline void store_param(void* param, ParamOut kind, int64_t i, float master) {
  if (kind == ParamOut::kFloat) {
    static_cast<float*>(param)[i] = master;
  } else if (kind == ParamOut::kBFloat16) {
    static_cast<uint16_t*>(param)[i] = float_to_bf16_bits(master);
  }
}

// Scalars of one AdamW step, rounded to fp32 the way ATen's foreach ops round them (from double).
struct AdamWScalars {
  float grad_scale;  // 1 = no clipping; else max_norm / (norm + 1e-6)
  float decay;       // 1 - lr * weight_decay
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  float eps;
  float step_size;  // -lr / (1 - beta1^step)
  bool scale_grad;  // grad_scale != 1 (ATen skips the mul_ then)
};

struct AdamWStep {
  const float* grad;
  float* exp_avg;
  float* exp_avg_sq;
  float* master;
  void* param;  // may be null with ParamOut::kNone
  ParamOut param_out;
  AdamWScalars s;

  MESHDDP_HD void operator()(int64_t i) const {
    float g = grad[i];
    if (s.scale_grad) g = g * s.grad_scale;                             // g.mul_(coef)
    float p = master[i] * s.decay;                                      // _foreach_mul_(master, 1 - lr*wd)
    float m = fmaf(g, s.one_minus_beta1, exp_avg[i] * s.beta1);         // mul_(b1); add_(g, 1 - b1)
    float v = fmaf(s.one_minus_beta2 * g, g, exp_avg_sq[i] * s.beta2);  // mul_(b2); addcmul_(g, g, 1 - b2)
    float denom = sqrtf(v) / s.bias_correction2_sqrt + s.eps;           // sqrt; div_; add_(eps)
    p = p + s.step_size * m / denom;                                    // addcdiv_(m, denom, step_size)
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    master[i] = p;
    store_param(param, param_out, i, p);
  }
};

// Scalars of one SGD step (dampening 0, no Nesterov), as in update_sgd.
struct SgdScalars {
  float grad_scale;
  float weight_decay;  // L2 added to the gradient; 0 = none
  float momentum;      // 0 = plain SGD (no buffer)
  float neg_lr;        // -lr
  bool scale_grad;
};

struct SgdStep {
  const float* grad;
  float* momentum_buffer;  // null when momentum == 0
  float* master;
  void* param;
  ParamOut param_out;
  SgdScalars s;

  MESHDDP_HD void operator()(int64_t i) const {
    float g = grad[i];
    if (s.scale_grad) g = g * s.grad_scale;
    float p = master[i];
    float d = s.weight_decay != 0 ? fmaf(p, s.weight_decay, g) : g;  // _foreach_add(grad, master, wd)
    if (momentum_buffer != nullptr) {
      d = momentum_buffer[i] * s.momentum + d;  // mul_(momentum); add_(d, 1.0): fmadd(d, 1, b) = b + d
      momentum_buffer[i] = d;
    }
    p = fmaf(d, s.neg_lr, p);  // add_(d, -lr)
    master[i] = p;
    store_param(param, param_out, i, p);
  }
};

}  // namespace meshddp::fused

namespace meshddp::fused {

// Sum of squares of the finite elements and the count of NaN/Inf ones, in one read. Both fp64 so
// the result is a 2-element fp64 tensor the caller adds into its all-reduce buffer as is.
struct GradStats {
  double sum_sq;
  double nonfinite;
};

struct SquareOrCount {
  const float* grad;
  MESHDDP_HD GradStats operator()(int64_t i) const {
    const float x = grad[i];
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    if ((u & 0x7f800000u) == 0x7f800000u) return {0.0, 1.0};
    const double d = x;
    return {d * d, 0.0};
  }
};

struct AddStats {
  MESHDDP_HD GradStats operator()(const GradStats& a, const GradStats& b) const {
    return {a.sum_sq + b.sum_sq, a.nonfinite + b.nonfinite};
  }
};

}  // namespace meshddp::fused
