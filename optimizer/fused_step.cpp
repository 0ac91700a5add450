// Checks and device dispatch for the fused kernels (fused_step.h): CPU runs fused_step_cpu.cpp over
// chunks on ATen's threads; CUDA runs fused_step.cu on the current stream.
#include "optimizer/fused_step.h"

#include "optimizer/fused_step_backends.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <vector>

#ifdef MESHDDP_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace meshddp {
namespace {

// Element-wise work per ATen task on CPU: large enough that a task outweighs its scheduling.
constexpr int64_t kCpuGrain = 1 << 15;

void check_operand(const at::Tensor& t, const at::Tensor& grad, const char* who, const char* name) {
  TORCH_CHECK(t.defined(), who, ": '", name, "' is undefined");
  TORCH_CHECK(t.scalar_type() == at::kFloat, who, ": '", name, "' must be fp32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), who, ": '", name, "' must be a contiguous 1-D tensor, got sizes ",
              t.sizes(), " strides ", t.strides());
  TORCH_CHECK(t.numel() == grad.numel(), who, ": '", name, "' has ", t.numel(), " elements, 'grad' has ", grad.numel());
  TORCH_CHECK(t.device() == grad.device(), who, ": '", name, "' is on ", t.device(), ", 'grad' on ", grad.device());
}

// Where the param goes: nowhere (undefined or the master itself), or an fp32/bf16 buffer.
std::pair<void*, fused::ParamOut> param_target(const at::Tensor& param, const at::Tensor& master, const char* who) {
  if (!param.defined() || param.data_ptr() == master.data_ptr()) return {nullptr, fused::ParamOut::kNone};
  TORCH_CHECK(
      param.dim() == 1 && param.is_contiguous() && param.numel() == master.numel() && param.device() == master.device(),
      who, ": 'param' must be a contiguous 1-D tensor of ", master.numel(), " elements on ", master.device(),
      ", got sizes ", param.sizes(), " on ", param.device());
  if (param.scalar_type() == at::kFloat) return {param.data_ptr(), fused::ParamOut::kFloat};
  TORCH_CHECK(param.scalar_type() == at::kBFloat16, who, ": 'param' must be fp32 or bf16, got ", param.scalar_type(),
              "; use the ATen path (DistributedOptimizer falls back to it) for other dtypes");
  return {param.data_ptr(), fused::ParamOut::kBFloat16};
}

#ifdef MESHDDP_WITH_CUDA
void* current_stream(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }
#endif

template <class F>
void run_elementwise(const F& f, const at::Tensor& like, void (*cpu)(const F&, int64_t, int64_t),
                     void (*cuda)(const F&, int64_t, void*)) {
  const int64_t n = like.numel();
  if (n == 0) return;
  if (like.is_cpu()) {
    at::parallel_for(0, n, kCpuGrain, [&](int64_t begin, int64_t end) { cpu(f, begin, end); });
    return;
  }
#ifdef MESHDDP_WITH_CUDA
  if (like.is_cuda()) {
    c10::cuda::CUDAGuard guard(like.device());
    cuda(f, n, current_stream(like));
    return;
  }
#endif
  TORCH_CHECK(false, "meshddp fused optimizer kernels: no build for device ", like.device(),
              " (CPU always; CUDA when built with the CUDA toolkit, MESHDDP_ENABLE_CUDA=ON)");
}

}  // namespace

bool fused_kernels_available(const c10::Device& device) {
#ifdef MESHDDP_WITH_CUDA
  if (device.is_cuda()) return true;
#endif
  return device.is_cpu();
}

fused::AdamWScalars adamw_scalars(double lr, double weight_decay, double beta1, double beta2, double eps, int64_t step,
                                  double grad_scale) {
  const double bias_correction1 = 1 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1 - std::pow(beta2, static_cast<double>(step));
  fused::AdamWScalars s;
  s.grad_scale = static_cast<float>(grad_scale);
  s.scale_grad = grad_scale != 1.0;
  s.decay = static_cast<float>(1 - lr * weight_decay);
  s.beta1 = static_cast<float>(beta1);
  s.one_minus_beta1 = static_cast<float>(1 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1 - beta2);
  s.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  s.eps = static_cast<float>(eps);
  s.step_size = static_cast<float>(-lr / bias_correction1);
  return s;
}

fused::SgdScalars sgd_scalars(double lr, double weight_decay, double momentum, double grad_scale) {
  fused::SgdScalars s;
  s.grad_scale = static_cast<float>(grad_scale);
  s.scale_grad = grad_scale != 1.0;
  s.weight_decay = static_cast<float>(weight_decay);
  s.momentum = static_cast<float>(momentum);
  s.neg_lr = static_cast<float>(-1 * lr);
  return s;
}

void fused_adamw_step(const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                      const at::Tensor& master, const at::Tensor& param, const fused::AdamWScalars& scalars) {
  const char* who = "fused_adamw_step";
  check_operand(grad, grad, who, "grad");
  check_operand(exp_avg, grad, who, "exp_avg");
  check_operand(exp_avg_sq, grad, who, "exp_avg_sq");
  check_operand(master, grad, who, "master");
  const auto [param_ptr, param_out] = param_target(param, master, who);
  const fused::AdamWStep f{grad.const_data_ptr<float>(),
                           exp_avg.data_ptr<float>(),
                           exp_avg_sq.data_ptr<float>(),
                           master.data_ptr<float>(),
                           param_ptr,
                           param_out,
                           scalars};
#ifdef MESHDDP_WITH_CUDA
  run_elementwise(f, grad, &fused::adamw_cpu, &fused::adamw_cuda);
#else
  run_elementwise<fused::AdamWStep>(f, grad, &fused::adamw_cpu, nullptr);
#endif
}

void fused_sgd_step(const at::Tensor& grad, const at::Tensor& momentum_buffer, const at::Tensor& master,
                    const at::Tensor& param, const fused::SgdScalars& scalars) {
  const char* who = "fused_sgd_step";
  check_operand(grad, grad, who, "grad");
  check_operand(master, grad, who, "master");
  TORCH_CHECK(momentum_buffer.defined() == (scalars.momentum != 0), who, ": 'momentum_buffer' must be given exactly ",
              "when momentum != 0 (momentum ", scalars.momentum, ", buffer ",
              momentum_buffer.defined() ? "given" : "undefined", ")");
  if (momentum_buffer.defined()) check_operand(momentum_buffer, grad, who, "momentum_buffer");
  const auto [param_ptr, param_out] = param_target(param, master, who);
  const fused::SgdStep f{grad.const_data_ptr<float>(),
                         momentum_buffer.defined() ? momentum_buffer.data_ptr<float>() : nullptr,
                         master.data_ptr<float>(),
                         param_ptr,
                         param_out,
                         scalars};
#ifdef MESHDDP_WITH_CUDA
  run_elementwise(f, grad, &fused::sgd_cpu, &fused::sgd_cuda);
#else
  run_elementwise<fused::SgdStep>(f, grad, &fused::sgd_cpu, nullptr);
#endif
}

void fused_grad_stats(const at::Tensor& grad, const at::Tensor& out) {
  const char* who = "fused_grad_stats";
  check_operand(grad, grad, who, "grad");
  TORCH_CHECK(out.defined() && out.scalar_type() == at::kDouble && out.numel() == 2 && out.is_contiguous() &&
                  out.device() == grad.device(),
              who, ": 'out' must be a contiguous 2-element fp64 tensor on ", grad.device(), ", got ",
              out.defined() ? out.toString() : "undefined", " of ", out.defined() ? out.numel() : 0, " elements");
  const int64_t n = grad.numel();
  if (grad.is_cpu()) {
    const float* g = grad.const_data_ptr<float>();
    const int64_t chunks = (n + kStatsChunk - 1) / kStatsChunk;
    std::vector<fused::GradStats> partial(chunks, fused::GradStats{0.0, 0.0});
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        partial[c] = fused::grad_stats_cpu(g, c * kStatsChunk, std::min(n, (c + 1) * kStatsChunk));
      }
    });
    fused::GradStats total{0.0, 0.0};
    for (const auto& p : partial) total = fused::AddStats{}(total, p);
    double* o = out.data_ptr<double>();
    o[0] += total.sum_sq;
    o[1] += total.nonfinite;
    return;
  }
#ifdef MESHDDP_WITH_CUDA
  if (grad.is_cuda()) {
    if (n == 0) return;
    c10::cuda::CUDAGuard guard(grad.device());
    void* stream = current_stream(grad);
    size_t temp_bytes = 0;
    const at::Tensor result = at::empty({2}, out.options());
    auto* result_ptr = reinterpret_cast<fused::GradStats*>(result.data_ptr<double>());
    fused::grad_stats_cuda(grad.const_data_ptr<float>(), n, result_ptr, nullptr, temp_bytes, stream);
    const at::Tensor temp = at::empty({static_cast<int64_t>(temp_bytes)}, grad.options().dtype(at::kByte));
    fused::grad_stats_cuda(grad.const_data_ptr<float>(), n, result_ptr, temp.data_ptr(), temp_bytes, stream);
    out.add_(result);
    return;
  }
#endif
  TORCH_CHECK(false, who, ": no build for device ", grad.device(),
              " (CPU always; CUDA when built with the CUDA toolkit, MESHDDP_ENABLE_CUDA=ON)");
}

}  // namespace meshddp
