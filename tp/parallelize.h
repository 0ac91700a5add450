// parallelize(): applies a tensor-parallel plan to a model written with the layers of
// tp/tp_layers.h, in place, over the mesh's TP dim. A plan maps module-path patterns ('*'
// matches any run, e.g. "blocks.*.mlp.fc1") to styles, as torchtitan's and veScale's plans do; the
// model code itself holds no parallelism.
//
//   parallelize(*model, mesh, {
//       {"wte", VocabParallel{}},                 {"wpe", SequenceSharded{}},
//       {"blocks.*.attn.q", ColwiseParallel{.unit = head_dim, .unit_name = "heads"}},
//       {"blocks.*.attn.o", RowwiseParallel{}},
//       {"blocks.*.mlp.fc1", ColwiseParallel{}}, {"blocks.*.mlp.fc2", RowwiseParallel{}},
//       {"blocks.*.ln*", SequenceParallelNorm{}}, {"ln_f", SequenceParallelNorm{}},
//       {"blocks.*.moe.experts", ExpertParallel{}}},
//     {.sequence_parallel = true});
//
// Validation (before anything changes; every message names the module, the style and the sizes):
// a pattern that matches nothing; a style on a module of the wrong type; a sharded size (features,
// heads, vocab) not divisible by the TP size; under sequence parallelism, a LayerNorm (meshddp's or
// torch's) left out of the plan (its gradient would be partial over TP without anyone summing it).
// Norms of other types (a user's RMSNorm, a qk-norm) cannot be recognised: give them
// SequenceParallelNorm in the plan, or declare their params with declare_sequence_parallel_param();
// DDP's TP-replica check (DdpConfig::tp_replica_check_interval) names any that slip through.
#pragma once

#include "../mesh/device_mesh.h"

#include <torch/nn/module.h>

#include <string>
#include <variant>
#include <vector>

namespace meshddp {

// Linear: split output features. `unit`: the sharded dim is made of units of this many features
// (e.g. attention heads of head_dim), each kept whole on one rank.
struct ColwiseParallel {
  bool gather_output = false;
  int64_t unit = 1;
  std::string unit_name = "features";
};
struct RowwiseParallel {};  // Linear: split input features; its input is a column-parallel output
struct VocabParallel {};    // Embedding: split the vocabulary (lookup and tied output projection)
struct SequenceSharded {};  // Embedding (positions): replicated; output sharded along the sequence (SP only)
// Any module applied to sequence-sharded activations under SP whose params are replicated (a
// LayerNorm, torch::nn::LayerNorm, a user's RMSNorm, a qk-norm): all its params get gradients that
// are partial sums over TP, summed by DDP once per step. No-op without SP.
struct SequenceParallelNorm {};
// Mixture of experts: every param of the module (and its children) is an expert param
// (declare_expert_param, mesh/placement.h): DDP reduces its gradient over the expert-data-parallel
// group (DdpConfig::expert_parallel_size) instead of DP. Any module type; TP-independent, so it
// composes with a TP style on the expert's own layers, e.g. {"experts.*.fc1", ColwiseParallel{}}
// listed before {"experts", ExpertParallel{}} (the first matching entry wins per module path).
struct ExpertParallel {};
using TpStyle = std::variant<ColwiseParallel, RowwiseParallel, VocabParallel, SequenceSharded, SequenceParallelNorm,
                             ExpertParallel>;

struct PlanEntry {
  std::string pattern;
  TpStyle style;
};

struct ParallelizeOptions {
  bool sequence_parallel = false;  // activations between TP regions split along dim 1 (sequence)
  std::string tp_dim = "tp";       // the mesh dim to parallelize over
};

void parallelize(torch::nn::Module& model, const DeviceMesh& mesh, const std::vector<PlanEntry>& plan,
                 const ParallelizeOptions& options = {});

// Declares one replicated param whose gradient is a partial sum over the mesh's TP dim (it is applied
// to sequence-sharded activations): DDP sums its gradient over TP once per step. For params the plan
// styles cannot reach (e.g. a gain inside a user's attention). No-op when the TP dim has size 1.
// Call before wrapping the model in DistributedDataParallel.
void declare_sequence_parallel_param(const at::Tensor& param, const DeviceMesh& mesh, const std::string& tp_dim = "tp");

}  // namespace meshddp
