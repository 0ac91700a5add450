// Gradients written in place (Megatron's gradient_accumulation_fusion): a layer's backward computes a
// parameter's gradient straight into the parameter's slot of the flat gradient buffer (the weight-
// gradient GEMM with `out=` the slot), instead of returning it to autograd, which would hand it to
// AccumulateGrad to be added into the slot: no temporary, no add pass, and no zeroing pass (see
// Note [Slots written in place] in grad_in_place.cpp). This header is what a layer calls; GradBuffer
// registers the slots it holds. No communication here.
//
// A layer's backward, for a parameter `w` whose gradient is G:
//   at::Tensor placeholder = write_grad_in_place(w, [&](const at::Tensor& slot, bool accumulate) {
//     accumulate ? slot.addmm_(A, B) : at::mm_out(slot, A, B);   // slot (+)= G, shaped like w
//   });
//   return placeholder.defined() ? placeholder : at::mm(A, B);    // as w's gradient
// tp/linear_with_grad_in_buffer.h is the ready-made linear layer that does this.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/FunctionRef.h>

namespace meshddp {

class GradBuffer;

// Computes the gradient into `slot` (a contiguous view of the flat buffer, shaped like the param, of
// the param's dtype). accumulate = false: the slot holds stale data (it was not zeroed), overwrite it
// (beta = 0); true: add to what the slot holds (later micro-batches, or a second use of the param).
using GradSlotWriter = c10::function_ref<void(const at::Tensor& slot, bool accumulate)>;

// Which slots a writer can fill. kParamDtype: only a slot of the param's own dtype. kParamDtypeOrFp32:
// also the fp32 main-grad slot of a bf16/fp16 param (GradBufferConfig::grad_reduce_in_fp32), which the
// writer must fill in fp32 from the low-precision operands, e.g. a GEMM with an fp32 output (on CUDA:
// at::mm_out / at::addmm_out with out_dtype, as Megatron's wgrad_gemm_accum_fp32): the gradient is
// then never rounded to bf16 before it is accumulated.
enum class SlotDtypes { kParamDtype, kParamDtypeOrFp32 };

// If a live GradBuffer (built with gradient_accumulation_fusion) holds `param` in a slot of the
// param's own dtype (or fp32, if `accepts` says so), this backward records no graph (grad mode off:
// not create_graph) and will accumulate into the param's .grad (not torch.autograd.grad, nor a
// backward(inputs=...) that leaves the param out: those return the gradient to the caller), calls
// `write` with that slot and returns the placeholder the caller must return from backward as the
// param's gradient: a zero tensor that allocates nothing per call, which the buffer's hook takes out
// before AccumulateGrad (so .grad is not touched twice) while the hook still marks the param ready
// as usual. Otherwise (no buffer, a slot of a dtype `accepts` does not cover, create_graph,
// autograd.grad, a step already synced) calls nothing and returns an undefined tensor: the caller computes and returns
// the gradient itself, and the buffer's hook handles it as any other gradient.
at::Tensor write_grad_in_place(const at::Tensor& param, GradSlotWriter write,
                               SlotDtypes accepts = SlotDtypes::kParamDtype);

// For GradBuffer: (un)registers `param` as slot `index` of `buffer`. unregister only removes an
// entry that still names `buffer` (a later buffer may have taken the param over).
void register_grad_slot(const at::Tensor& param, GradBuffer* buffer, int64_t index);
void unregister_grad_slot(const at::Tensor& param, const GradBuffer* buffer);

}  // namespace meshddp
