#include "tp/linear_with_grad_in_buffer.h"

#include "grad_buffer/grad_in_place.h"

#include <ATen/autocast_mode.h>
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

// Note [Autocast through the in-buffer linear]
// Under torch.autocast, F.linear casts its floating-point operands (fp64 excepted) to the autocast
// dtype of their device and runs there; its backward returns each gradient in its operand's own
// dtype (the casts' backward). This Function does the same: the forward casts what autocast would
// cast and saves the cast operands (as autocast's linear does), the backward computes in that
// dtype and returns or writes each gradient in its param's dtype: into an fp32 slot, on CUDA by a
// GEMM with an fp32 output (no rounding to bf16 first), on CPU (no such GEMM in ATen) by a GEMM in
// the compute dtype added into the slot (as F.linear's gradient, rounded to bf16 then widened).
// No cache: autocast's weight-cast cache would keep a cast made here, under no-grad, for later
// ops of the region.
// Double backward (create_graph, e.g. a gradient penalty): the input is cast before the Function
// (linear_with_grad_in_buffer), with its graph, so grad_weight = grad_out^T x_cast reaches the input
// through the cast's backward, as F.linear's does. The weight's and bias's casts are made in the
// forward, under no-grad (the Function needs the params themselves for their slots), so a backward
// that records a graph re-casts the saved params with it: grad_input = grad_out W_cast reaches the
// weight. Without autocast the operands are the originals and nothing is re-cast.
at::Tensor cast_for_autocast(const at::Tensor& t, c10::DeviceType device, c10::ScalarType dtype) {
  if (!t.defined() || !t.is_floating_point() || t.scalar_type() == at::kDouble || t.device().type() != device) return t;
  return t.scalar_type() == dtype ? t : t.to(dtype);
}

struct LinearWithGradInBuffer : torch::autograd::Function<LinearWithGradInBuffer> {
  // The bias is optional (an undefined tensor cannot be a custom Function's input).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
    const at::Tensor b = bias.value_or(at::Tensor());
    at::Tensor x = input, w = weight, bb = b;
    const c10::DeviceType device = input.device().type();
    if (at::autocast::is_autocast_enabled(device)) {
      const c10::ScalarType dtype = at::autocast::get_autocast_dtype(device);
      x = cast_for_autocast(input, device, dtype);
      w = cast_for_autocast(weight, device, dtype);
      bb = cast_for_autocast(b, device, dtype);
    }
    // The operands as computed with; weight and bias themselves for their identity (their slots).
    ctx->save_for_backward({x, w, weight, b});
    return at::linear(x, w, bb);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];   // as computed with (autocast: cast before the Function, with its graph)
    const at::Tensor& weight = saved[2];  // the param
    // As computed with (autocast: cast under no-grad; re-cast with its graph for a double backward).
    const at::Tensor w = torch::autograd::GradMode::is_enabled() && saved[1].scalar_type() != weight.scalar_type()
                             ? weight.to(saved[1].scalar_type())
                             : saved[1];
    const at::Tensor& bias = saved[3];
    const int64_t out_features = w.size(0), in_features = w.size(1);
    const at::Tensor grad_out = grads[0].reshape({-1, out_features});

    at::Tensor grad_input;
    if (ctx->needs_input_grad(0)) {
      auto sizes = input.sizes().vec();
      grad_input = grad_out.mm(w).view(sizes).to(input.scalar_type());
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
            if (widen && !slot.is_cuda()) {
              // No GEMM with a wider output on CPU (Note [Autocast through the in-buffer linear]).
              const at::Tensor g = grad_out_t.mm(input_2d);
              accumulate ? slot.add_(g) : slot.copy_(g);
            } else if (accumulate && widen) {
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
      if (!grad_weight.defined()) grad_weight = grad_out_t.mm(input_2d).to(weight.scalar_type());
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
      if (!grad_bias.defined()) grad_bias = grad_out.sum(0, /*keepdim=*/false, bias.scalar_type());
    }
    return {grad_input, grad_weight, grad_bias};
  }
};

}  // namespace

at::Tensor linear_with_grad_in_buffer(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias) {
  // Under autocast the input is cast here, with its graph (Note [Autocast through the in-buffer linear]).
  const c10::DeviceType device = input.device().type();
  const at::Tensor x = at::autocast::is_autocast_enabled(device)
                           ? cast_for_autocast(input, device, at::autocast::get_autocast_dtype(device))
                           : input;
  return LinearWithGradInBuffer::apply(x, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
}

}  // namespace meshddp
