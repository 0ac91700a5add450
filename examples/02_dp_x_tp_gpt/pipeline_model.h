// The tiny GPT cut into model chunks for pipeline parallelism: chunk c of C holds blocks
// [c L / C, (c + 1) L / C), chunk 0 also the token and position embeddings, chunk C - 1 the final norm
// and the LM head. Chunks are cut out of a whole gpt::Gpt (taking its modules), so they start from the
// one-process model's weights; blocks keep their global names ("blocks.5.attn.q" on whichever rank
// holds layer 5), which is what lets a checkpoint saved at one pipeline size load at another.
//
// The LM head is tied to the token embedding. Within one chunk (pp 1) it IS the embedding's tensor,
// registered under both names "wte.weight" and "lm_head.weight"; when the first and last chunks live
// on different ranks the last chunk holds a copy under "lm_head.weight", both copies are declared
// tied across stages (pipeline_train.cpp), and DDP sums their gradients over the embedding group, so
// they stay bit-identical (docs/guide/pipelines.md). Not parallelism itself: pipeline_train.cpp places the
// chunks and gpt_plan.h still splits them over TP.
#pragma once

#include "examples/02_dp_x_tp_gpt/gpt.h"
#include "examples/02_dp_x_tp_gpt/gpt_plan.h"

#include <torch/torch.h>

#include <meshddp/meshddp.h>
#include <string>
#include <vector>

namespace gpt {

struct GptChunkImpl : torch::nn::Module {
  // Chunk `chunk` of `chunks` of `whole` (built from `c`, whose layers divide by `chunks`).
  GptChunkImpl(GptImpl& whole, const Config& c, int64_t chunk, int64_t chunks)
      : first_layer(chunk * (c.layers / chunks)),
        layer_count(c.layers / chunks),
        is_first(chunk == 0),
        is_last(chunk == chunks - 1) {
    if (is_first) {
      wte = register_module("wte", whole.wte);
      wpe = register_module("wpe", whole.wpe);
    }
    // A plain holder, so that each block keeps its global index as its name.
    blocks = register_module("blocks", std::make_shared<torch::nn::Module>());
    for (int64_t l = first_layer; l < first_layer + layer_count; ++l) {
      layers.push_back(blocks->register_module(std::to_string(l), whole.blocks->ptr<BlockImpl>(l)));
    }
    if (is_last) {
      ln_f = register_module("ln_f", whole.ln_f);
      // The tie: the same tensor in one chunk, else a copy (same initial values) for the last stage.
      lm_head = register_module("lm_head",
                                meshddp::tp::Linear(is_first ? whole.wte->weight : whole.wte->weight.detach().clone()));
    }
  }
  // Context parallel as GptImpl::set_context_parallel (positions are global; attention gathers keys).
  void set_context_parallel(meshddp::tp::Group* group) {
    cp = group;
    for (auto& block : layers) block->attn->cp = group;
  }
  // The first chunk takes ids [B, T], the others the previous chunk's hidden states [B, T', dim]
  // (T' = this rank's share of the sequence under CP and sequence parallelism); the last chunk returns
  // logits [B, T, vocab / tp], the others hidden states.
  torch::Tensor forward(const torch::Tensor& input) {
    torch::Tensor h = input;
    if (is_first) {
      const int64_t start = cp ? cp->getRank() * input.size(1) : 0;  // global position of ids[:, 0]
      auto positions = torch::arange(start, start + input.size(1), torch::kLong).unsqueeze(0);
      h = wte(input) + wpe(positions);
    }
    for (auto& block : layers) h = block->forward(h);
    return is_last ? lm_head(ln_f(h)) : h;
  }

  const int64_t first_layer, layer_count;
  const bool is_first, is_last;
  meshddp::tp::Embedding wte{nullptr}, wpe{nullptr};
  std::shared_ptr<torch::nn::Module> blocks;
  std::vector<std::shared_ptr<BlockImpl>> layers;
  meshddp::tp::LayerNorm ln_f{nullptr};
  meshddp::tp::Linear lm_head{nullptr};
  meshddp::tp::Group* cp = nullptr;
};
TORCH_MODULE(GptChunk);

// The TP plan (gpt_plan.h, with the LM head as a module) restricted to what `chunk` holds: a pattern
// that matches nothing is an error in parallelize().
inline std::vector<meshddp::PlanEntry> chunk_plan(const Config& c, const GptChunkImpl& chunk) {
  Config with_head = c;
  with_head.lm_head_module = true;
  std::vector<meshddp::PlanEntry> plan;
  for (auto& entry : tp_plan(with_head)) {
    const std::string& p = entry.pattern;
    const bool embedding = p == "wte" || p == "wpe", head = p == "ln_f" || p == "lm_head";
    if ((embedding && !chunk.is_first) || (head && !chunk.is_last)) continue;
    plan.push_back(entry);
  }
  return plan;
}

}  // namespace gpt
