// A tiny GPT written as a plain single-device LibTorch module: token and position embeddings, N
// pre-norm blocks (causal self-attention + MLP), a final norm and an LM head tied to the token
// embedding. No parallelism here: gpt_plan.h parallelizes it. Shapes are read from tensors (heads
// from the projection's width / head_dim, the sequence length from q), so the same code runs on one
// device, on TP shards, and on sequence shards. Context parallel (set_context_parallel): each rank of
// the CP group holds a contiguous slice of every sequence; positions are global and attention
// all-gathers keys and values over CP (docs/guide/parallelism.md). With experts > 0 each block's MLP is
// a dropless mixture of experts (moe.h; expert parallel: set_expert_parallel, docs/guide/parallelism.md).
#pragma once

#include "examples/02_dp_x_tp_gpt/moe.h"
#include "tp/tp_functions.h"

#include <torch/torch.h>

#include <cmath>
#include <meshddp/meshddp.h>

namespace gpt {

struct Config {
  int64_t vocab = 64;
  int64_t seq_len = 16;
  int64_t dim = 32;
  int64_t heads = 4;
  int64_t layers = 2;
  int64_t mlp_ratio = 4;
  // The LM head as a module of its own ("lm_head", a tp::Linear) whose weight IS the token
  // embedding's tensor, registered under both names (how C++ models usually tie weights). Same
  // math as wte->unembed(); DDP must see one parameter.
  bool lm_head_module = false;
  // Mixture of experts: 0 = a dense MLP per block; E > 0 = an MoE layer of E experts (each an MLP of
  // the same shape) per block ("blocks.<l>.moe.router", "blocks.<l>.moe.experts.<e>.fc1"), each
  // token going to its top_k experts.
  int64_t experts = 0;
  int64_t top_k = 2;
  int64_t head_dim() const { return dim / heads; }
};

struct AttentionImpl : torch::nn::Module {
  AttentionImpl(const Config& c)
      : head_dim(c.head_dim()),
        q(register_module("q", meshddp::tp::Linear(c.dim, c.dim))),
        // No key bias: softmax is invariant to it, so its true gradient is 0 and what autograd
        // returns is rounding noise, which Adam would turn into lr-sized random steps.
        k(register_module("k", meshddp::tp::Linear(c.dim, c.dim, /*bias=*/false))),
        v(register_module("v", meshddp::tp::Linear(c.dim, c.dim))),
        o(register_module("o", meshddp::tp::Linear(c.dim, c.dim))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto split = [&](const torch::Tensor& t) {  // [B, T, h * d] -> [B, h, T, d]
      return t.view({t.size(0), t.size(1), -1, head_dim}).transpose(1, 2);
    };
    // q before k and v, as autograd numbers them: backward then sums x's gradient contributions in
    // the same order on one process and at any CP size (a different order changes the last bits).
    auto queries = q(x);
    auto keys = k(x), values = v(x);
    int64_t offset = 0;  // global position of this rank's first query
    if (cp && cp->getSize() > 1) {
      // Local queries attend to the whole sequence: keys and values are all-gathered over CP in
      // forward (their gradients reduce-scattered back in backward). Under sequence parallelism the
      // TP gather already happened inside k and v, so this gathers whole CP slices.
      offset = cp->getRank() * keys.size(1);
      keys = meshddp::tp::gather_sequence(keys, cp);
      values = meshddp::tp::gather_sequence(values, cp);
    }
    auto qh = split(queries), kh = split(keys), vh = split(values);
    const int64_t T = qh.size(2);
    auto scores = torch::matmul(qh, kh.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim));
    // Query i (global position offset + i) sees keys 0..offset + i.
    auto causal = torch::ones({T, kh.size(2)}, torch::kBool).triu(1 + offset);
    auto att = torch::softmax(scores.masked_fill(causal, -std::numeric_limits<float>::infinity()), -1);
    auto y = torch::matmul(att, vh).transpose(1, 2).contiguous();
    return o(y.view({y.size(0), T, -1}));
  }
  int64_t head_dim;
  meshddp::tp::Linear q, k, v, o;
  meshddp::tp::Group* cp = nullptr;  // the context-parallel group (null: the whole sequence is here)
};
TORCH_MODULE(Attention);

struct BlockImpl : torch::nn::Module {
  BlockImpl(const Config& c)
      : ln1(register_module("ln1", meshddp::tp::LayerNorm(c.dim))),
        attn(register_module("attn", Attention(c))),
        ln2(register_module("ln2", meshddp::tp::LayerNorm(c.dim))) {
    if (c.experts > 0)
      moe = register_module("moe", Moe(c.dim, c.dim * c.mlp_ratio, c.experts, c.top_k));
    else
      mlp = register_module("mlp", Mlp(c.dim, c.dim * c.mlp_ratio));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = x + attn(ln1(x));
    return x + (moe ? moe(ln2(x)) : mlp(ln2(x)));
  }
  meshddp::tp::LayerNorm ln1;
  Attention attn;
  meshddp::tp::LayerNorm ln2;
  Mlp mlp{nullptr};  // the dense MLP (experts == 0)
  Moe moe{nullptr};  // or the mixture of experts
};
TORCH_MODULE(Block);

struct GptImpl : torch::nn::Module {
  explicit GptImpl(const Config& c)
      : wte(register_module("wte", meshddp::tp::Embedding(c.vocab, c.dim))),
        wpe(register_module("wpe", meshddp::tp::Embedding(c.seq_len, c.dim))),
        ln_f(register_module("ln_f", meshddp::tp::LayerNorm(c.dim))) {
    for (int64_t l = 0; l < c.layers; ++l) blocks->push_back(Block(c));
    register_module("blocks", blocks);
    if (c.lm_head_module) lm_head = register_module("lm_head", meshddp::tp::Linear(wte->weight));
  }
  // Context parallel over `cp` (kept by pointer; must outlive the model): forward then takes this
  // rank's slice of each sequence, tokens [r * T / cp, (r + 1) * T / cp) for CP rank r.
  void set_context_parallel(meshddp::tp::Group* group) {
    cp = group;
    for (const auto& block : *blocks) block->as<BlockImpl>()->attn->cp = group;
  }
  // Expert parallel over `group` (kept by pointer; must outlive the model): each MoE layer keeps its
  // block of the experts (MoeImpl::set_expert_parallel). No-op without experts.
  void set_expert_parallel(meshddp::tp::Group* group) {
    for (const auto& block : *blocks) {
      if (auto& moe = block->as<BlockImpl>()->moe) moe->set_expert_parallel(group);
    }
  }
  // ids [B, T] -> logits [B, T, vocab] (this rank's vocab shard once parallelized).
  torch::Tensor forward(const torch::Tensor& ids) {
    const int64_t start = cp ? cp->getRank() * ids.size(1) : 0;  // global position of ids[:, 0]
    auto positions = torch::arange(start, start + ids.size(1), torch::kLong).unsqueeze(0);
    auto h = wte(ids) + wpe(positions);
    for (const auto& block : *blocks) h = block->as<BlockImpl>()->forward(h);
    return lm_head ? lm_head(ln_f(h)) : wte->unembed(ln_f(h));
  }
  meshddp::tp::Embedding wte, wpe;
  torch::nn::ModuleList blocks;
  meshddp::tp::LayerNorm ln_f;
  meshddp::tp::Linear lm_head{nullptr};
  meshddp::tp::Group* cp = nullptr;
};
TORCH_MODULE(Gpt);

// Synthetic data from (seed, step): a noisy "next token = (token * 3 + 1) mod vocab" language,
// learnable, no downloads. Returns ids and targets [batch, seq_len].
inline std::pair<torch::Tensor, torch::Tensor> make_batch(const Config& c, uint64_t seed, int64_t step, int64_t batch) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 7919 + static_cast<uint64_t>(step));
  auto start = torch::randint(c.vocab, {batch, 1}, gen);
  auto seq = torch::empty({batch, c.seq_len + 1}, torch::kLong);
  seq.select(1, 0).copy_(start.squeeze(1));
  auto noise = torch::rand({batch, c.seq_len}, gen) < 0.1;
  auto random = torch::randint(c.vocab, {batch, c.seq_len}, gen);
  for (int64_t t = 0; t < c.seq_len; ++t) {
    auto next = (seq.select(1, t) * 3 + 1).remainder(c.vocab);
    seq.select(1, t + 1).copy_(torch::where(noise.select(1, t), random.select(1, t), next));
  }
  return {seq.narrow(1, 0, c.seq_len).contiguous(), seq.narrow(1, 1, c.seq_len).contiguous()};
}

// --loss per-token: sequences of random valid length (from (seed, step), at least a quarter of
// seq_len), padding after it. true where a target counts. [batch, seq_len]; the whole global batch,
// so every rank knows the global count of valid tokens without communicating.
inline torch::Tensor valid_mask(const Config& c, uint64_t seed, int64_t step, int64_t batch) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 7919 + static_cast<uint64_t>(step) + 0x5eed);
  auto lengths = torch::randint(std::max<int64_t>(1, c.seq_len / 4), c.seq_len + 1, {batch, 1}, gen);
  return torch::arange(c.seq_len).unsqueeze(0) < lengths;
}

// The sum of the cross-entropy over the tokens `valid` marks (logits [N, V or V / tp], targets and
// valid [N]): mean over them times their count, a zero that keeps the graph when there are none.
inline torch::Tensor loss_sum(const torch::Tensor& logits, const torch::Tensor& targets, const torch::Tensor& valid,
                              meshddp::tp::Group* vocab_group) {
  const auto rows = valid.nonzero().squeeze(1);
  if (rows.numel() == 0) return logits.sum() * 0.0;
  return meshddp::tp::cross_entropy(logits.index_select(0, rows), targets.index_select(0, rows), vocab_group) *
         static_cast<double>(rows.numel());
}

}  // namespace gpt
