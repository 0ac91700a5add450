// The examples' precision: --dtype fp32|bf16 and --grad-reduce-in-bf16, the way Megatron jobs train
// in bf16 (bf16 params and activations; gradients accumulated and reduced in fp32 main grads unless
// --grad-reduce-in-bf16; fp32 master weights and optimizer state), plus Fp32MasterParams, the fp32
// master copy that plain DDP steps (Megatron's Float16OptimizerWithFloat16Params; ZeRO-1's
// DistributedOptimizer keeps its own fp32 masters). What each buffer holds: docs/reference/optimizer.md.
#pragma once

#include "examples/common/flags.h"

#include <ATen/core/Tensor.h>

#include <meshddp/meshddp.h>
#include <string>
#include <vector>

namespace examples {

struct PrecisionFlags {
  bool bf16 = false;                 // --dtype bf16: params and activations in bf16 (fp32: everything fp32)
  bool grad_reduce_in_bf16 = false;  // --grad-reduce-in-bf16: main grads accumulated and reduced in bf16;
                                     // without it a bf16 run keeps fp32 main grads (grad_reduce_in_fp32)
  at::ScalarType param_dtype() const { return bf16 ? at::kBFloat16 : at::kFloat; }
  bool grad_reduce_in_fp32() const { return bf16 && !grad_reduce_in_bf16; }
};

inline const char* precision_usage() { return "[--dtype fp32|bf16 [--grad-reduce-in-bf16]]"; }

// Parses `--grad-reduce-in-bf16` (no value) into `f`; false if `arg` is not it.
bool parse_precision_switch(const std::string& arg, PrecisionFlags& f);
// Parses `--dtype fp32|bf16` into `f`; false if `arg` is not it. Throws FlagError on another value.
bool parse_precision_flag(const std::string& arg, const std::string& value, PrecisionFlags& f);
// Cross-flag checks; throws FlagError naming the flags. --grad-reduce-in-bf16 needs --dtype bf16;
// plain DDP's fp32 masters (Fp32MasterParams) are not part of a checkpoint, so --dtype bf16 with
// --save-dir needs --distributed-optimizer, whose fp32 masters and state are.
void validate_precision_flags(const PrecisionFlags& f, bool distributed_optimizer, bool checkpoints);

class Fp32MasterParams;

// "fp32", "bf16", "fp16" (else c10's name): how the step log writes a dtype.
const char* dtype_name(at::ScalarType t);

// "# dtypes: params bf16, activations bf16, main grads fp32 (reduced in fp32), masters fp32 (this
// rank's ZeRO-1 shard), optimizer state fp32": the step log's header line. Read from the buffers
// themselves (a param, its main grad, the comm hook, ZeRO-1's master bytes), not from the flags, so that a run
// that reduces in another dtype than asked says so. `zero1` / `masters`: null when not used.
std::string precision_header(const meshddp::DdpEngine& ddp, const meshddp::DistributedOptimizer* zero1,
                             const Fp32MasterParams* masters);

// Plain DDP with bf16 params: an fp32 copy of every trainable param (Megatron's
// Float16OptimizerWithFloat16Params), which the torch optimizer steps. Per step:
//   ddp.finish_grad_sync();  masters.take_grads(ddp);  optimizer.step();  masters.write_params();
class Fp32MasterParams {
 public:
  // An fp32 copy of each of `ddp`'s trainable params (frozen ones get none), in ddp.parameters() order.
  explicit Fp32MasterParams(const meshddp::DdpEngine& ddp);
  // Give these to the optimizer.
  const std::vector<at::Tensor>& masters() const { return masters_; }
  // Each master's .grad becomes its param's synced main grad: the buffer's fp32 slot itself with
  // grad_reduce_in_fp32, an fp32 copy of the bf16 slot otherwise. After finish_grad_sync().
  void take_grads(const meshddp::DdpEngine& ddp);
  // Each param takes its master rounded to the param's dtype (round to nearest even). After step().
  void write_params();

 private:
  std::vector<std::string> names_;
  std::vector<at::Tensor> params_, masters_;
};

}  // namespace examples
