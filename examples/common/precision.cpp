#include "examples/common/precision.h"

#include "grad_buffer/grad_buffer.h"  // main_grad_dtype: GradBuffer is not in the front end

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

namespace examples {

bool parse_precision_switch(const std::string& arg, PrecisionFlags& f) {
  if (arg != "--grad-reduce-in-bf16") return false;
  f.grad_reduce_in_bf16 = true;
  return true;
}

bool parse_precision_flag(const std::string& arg, const std::string& value, PrecisionFlags& f) {
  if (arg != "--dtype") return false;
  f.bf16 = parse_choice_flag(arg, value, {"fp32", "bf16"}) == "bf16";
  return true;
}

void validate_precision_flags(const PrecisionFlags& f, bool distributed_optimizer, bool checkpoints) {
  if (f.grad_reduce_in_bf16 && !f.bf16) {
    throw FlagError("--grad-reduce-in-bf16 needs --dtype bf16 (fp32 params already reduce in fp32)");
  }
  if (f.bf16 && checkpoints && !distributed_optimizer) {
    throw FlagError(
        "--dtype bf16 with --save-dir needs --distributed-optimizer: plain DDP's fp32 master weights are not part "
        "of a checkpoint (ZeRO-1's fp32 masters and optimizer state are, at any mesh)");
  }
}

const char* dtype_name(at::ScalarType t) {
  return t == at::kFloat ? "fp32" : t == at::kBFloat16 ? "bf16" : t == at::kHalf ? "fp16" : c10::toString(t);
}

std::string precision_header(const meshddp::DdpEngine& ddp, const meshddp::DistributedOptimizer* zero1,
                             const Fp32MasterParams* masters) {
  const meshddp::NamedParam* first = nullptr;
  for (const auto& p : ddp.named_parameters()) {
    if (p.param.requires_grad()) {
      first = &p;
      break;
    }
  }
  if (first == nullptr) return "# dtypes: no trainable params";
  const std::string param = dtype_name(first->param.scalar_type());
  // The first trainable param's main-grad dtype (its slot's: no whole main grad under optim_grads).
  const std::string grad = dtype_name(ddp.grad_buffer()->main_grad_dtype(0));
  // A compression hook reduces the buffer in its own dtype.
  const std::string& hook = ddp.config().comm_hook;
  const std::string reduced = hook == meshddp::kBf16CompressHook   ? std::string("bf16")
                              : hook == meshddp::kFp16CompressHook ? std::string("fp16")
                                                                   : grad;
  std::string master = "masters: the params themselves";
  if (zero1 != nullptr && zero1->memory().master_weight_bytes > 0) master = "masters fp32 (this rank's ZeRO-1 shard)";
  if (masters != nullptr) master = "masters fp32 (a whole copy, as Float16OptimizerWithFloat16Params)";
  return "# dtypes: params " + param + ", activations " + param + ", main grads " + grad + " (reduced in " + reduced +
         "), " + master + ", optimizer state fp32";
}

Fp32MasterParams::Fp32MasterParams(const meshddp::DdpEngine& ddp) {
  c10::NoGradGuard no_grad;
  for (const auto& p : ddp.named_parameters()) {
    if (!p.param.requires_grad()) continue;
    names_.push_back(p.name);
    params_.push_back(p.param);
    masters_.push_back(p.param.detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true).requires_grad_(true));
  }
}

void Fp32MasterParams::take_grads(const meshddp::DdpEngine& ddp) {
  for (size_t i = 0; i < masters_.size(); ++i) {
    const at::Tensor main_grad = ddp.main_grad(names_[i]);
    // An fp32 slot is the gradient itself (no copy); a bf16 one is widened exactly.
    masters_[i].mutable_grad() = main_grad.scalar_type() == at::kFloat ? main_grad : main_grad.to(at::kFloat);
  }
}

void Fp32MasterParams::write_params() {
  c10::NoGradGuard no_grad;
  at::_foreach_copy_(params_, masters_);
}

}  // namespace examples
