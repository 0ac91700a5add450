// The tensor-parallel plan of the tiny GPT: which layer is split how. This file, not the model, is
// where the parallelism lives (docs/guide/parallelism.md explains how to write one).
#pragma once

#include "examples/02_dp_x_tp_gpt/gpt.h"

#include <meshddp/meshddp.h>

namespace gpt {

inline std::vector<meshddp::PlanEntry> tp_plan(const Config& c) {
  using namespace meshddp;
  const ColwiseParallel heads{.unit = c.head_dim(), .unit_name = "heads"};
  std::vector<PlanEntry> plan{
      {"wte", VocabParallel{}},    // vocab-split lookup; tied LM head gives vocab-split logits
      {"wpe", SequenceSharded{}},  // under SP: each rank keeps its sequence chunk
      {"blocks.*.attn.q", heads},  // heads split across TP ranks
      {"blocks.*.attn.k", heads},
      {"blocks.*.attn.v", heads},
      {"blocks.*.attn.o", RowwiseParallel{}},  // back to full width (all-reduce / reduce-scatter)
      // A mixture of experts splits each (local) expert like the dense MLP (expert tensor parallel =
      // TP: the TP peers of an EP rank receive the same tokens); its router stays replicated.
      {c.experts > 0 ? "blocks.*.moe.experts.*.fc1" : "blocks.*.mlp.fc1", ColwiseParallel{}},
      {c.experts > 0 ? "blocks.*.moe.experts.*.fc2" : "blocks.*.mlp.fc2", RowwiseParallel{}},
      {"blocks.*.ln*", SequenceParallelNorm{}},  // under SP: norms on sequence shards, partial grads
      {"ln_f", SequenceParallelNorm{}},
  };
  // A tied LM head module shares wte's tensor: column-parallel splits it on the vocab dim, as
  // VocabParallel already did (it is sharded once), giving vocab-split logits like unembed().
  if (c.lm_head_module) plan.push_back({"lm_head", ColwiseParallel{}});
  // Every param of the (local) experts is an expert param: DDP reduces its gradient over the
  // expert-data-parallel group (DdpConfig::expert_parallel_size), the router's over DP (x CP). After the
  // TP entries above, which split the experts' own layers.
  if (c.experts > 0) plan.push_back({"blocks.*.moe.experts", ExpertParallel{}});
  return plan;
}

}  // namespace gpt
