#include "plugin/linear_with_grad_in_buffer.h"

#include "grad_buffer/grad_in_place.h"

#include <ATen/ops/addmm.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sum.h>
#include <torch/autograd.h>

#include <optional>

namespace meshddp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct LinearWithGradInBuffer : torch::autograd::Function<LinearWithGradInBuffer> {
  // The bias is optional (an undefined tensor cannot be a custom Function's input).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
    const at::Tensor b = bias.value_or(at::Tensor());
    ctx->save_for_backward({input, weight, b});  // weight and bias for their identity (their slots)
    return at::linear(input, weight, b);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& bias = saved[2];
    const int64_t out_features = weight.size(0), in_features = weight.size(1);
    const at::Tensor grad_out = grads[0].reshape({-1, out_features});

    at::Tensor grad_input;
    if (ctx->needs_input_grad(0)) {
      auto sizes = input.sizes().vec();
      grad_input = grad_out.mm(weight).view(sizes);
    }
    // fp32 main grads of bf16/fp16 params: written by a GEMM with an fp32 output, which ATen has on
    // CUDA only (mm/addmm with out_dtype); on CPU such params take the autograd path.
    const SlotDtypes accepts = grad_out.is_cuda() ? SlotDtypes::kParamDtypeOrFp32 : SlotDtypes::kParamDtype;
    at::Tensor grad_weight, grad_bias;
    if (ctx->needs_input_grad(1)) {
      const at::Tensor input_2d = input.reshape({-1, in_features});
      const at::Tensor grad_out_t = grad_out.t();
      grad_weight = write_grad_in_place(
          weight,
          [&](const at::Tensor& slot, bool accumulate) {
            at::Tensor out = slot;
            const bool widen = slot.scalar_type() != grad_out.scalar_type();  // fp32 slot, bf16 operands
            if (accumulate && widen) {
              at::addmm_out(out, slot, grad_out_t, input_2d, slot.scalar_type());
            } else if (accumulate) {
              slot.addmm_(grad_out_t, input_2d);
            } else if (widen) {
              at::mm_out(out, grad_out_t, input_2d, slot.scalar_type());
            } else {
              at::mm_out(out, grad_out_t, input_2d);
            }
          },
          accepts);
      if (!grad_weight.defined()) grad_weight = grad_out_t.mm(input_2d);
    }
    if (bias.defined() && ctx->needs_input_grad(2)) {
      grad_bias = write_grad_in_place(
          bias,
          [&](const at::Tensor& slot, bool accumulate) {
            // Summed into the slot's dtype (fp32 main grads: the sum is not rounded to bf16).
            if (accumulate) {
              slot.add_(grad_out.sum(0, /*keepdim=*/false, slot.scalar_type()));
            } else {
              at::Tensor out = slot;
              at::sum_out(out, grad_out, {0}, /*keepdim=*/false, slot.scalar_type());
            }
          },
          accepts);
      if (!grad_bias.defined()) grad_bias = grad_out.sum(0);
    }
    return {grad_input, grad_weight, grad_bias};
  }
};

}  // namespace

at::Tensor linear_with_grad_in_buffer(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias) {
  return LinearWithGradInBuffer::apply(input, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
}

}  // namespace meshddp
