// y = x W^T + b (torch::linear), with a backward that writes W's and b's gradients straight into their
// slots of the DDP flat gradient buffer (Megatron's gradient_accumulation_fusion,
// grad_buffer/grad_in_place.h): the weight-gradient GEMM runs with `out=` the slot (beta = 0 on the
// step's first micro-batch, 1 after), so no weight-gradient temporary is allocated, nothing adds it
// into the buffer, and nothing zeroes the buffer between steps. meshddp::tp::Linear uses it in every
// style; call it from your own layers' forward to get the same, e.g. with a torch::nn::Linear:
//   x = meshddp::linear_with_grad_in_buffer(x, fc->weight, fc->bias);   // instead of fc(x)
// Forward and gradients are the same ops as torch::linear's (the golden runs this function too, with
// no buffer, where it is a plain linear). bf16/fp16 params with fp32 main grads (grad_reduce_in_fp32):
// on CUDA the GEMM writes fp32 from the bf16 operands (mm/addmm with out_dtype; the gradient is not
// rounded to bf16 before it is accumulated, as Megatron's wgrad_gemm_accum_fp32); ATen has no such
// GEMM on CPU, where these params take the autograd path. When a param is not in a buffer that can
// take it (no DDP, gradient_accumulation_fusion off, create_graph), or the backward will not
// accumulate into its .grad (torch::autograd::grad / torch.autograd.grad, backward(inputs=...)
// without it), its gradient is returned to autograd as usual and the buffer is left alone.
// Under autocast (torch.autocast, CPU or CUDA) it behaves as torch::linear / F.linear does: the
// operands are cast to the autocast dtype, the output is in it, and each gradient comes back (or
// into its slot) in its param's dtype (Note [Autocast through the in-buffer linear] in the .cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace meshddp {

// input [..., in], weight [out, in], bias [out] or undefined -> [..., out].
at::Tensor linear_with_grad_in_buffer(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias = {});

}  // namespace meshddp
