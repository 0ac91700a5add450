// A dropless mixture-of-experts layer for the tiny GPT (the MLP of each block when --experts > 0).
// Plain model code: it runs in one process with every expert local (the golden); set_expert_parallel
// keeps a contiguous block of the experts on each rank of an EP group, and the tokens then travel to
// their experts and back by all-to-all (tp/expert_parallel.h; docs/guide/parallelism.md).
//
// Routing (Switch / Megatron-core's pre-softmax router): gates = softmax over all E router logits,
// then each token takes its top-k experts with those (unrenormalised) probabilities as weights, so
// the router gets a gradient even at k = 1. Dropless: no capacity, every token reaches its k experts.
// No auxiliary load-balancing loss: the loss is the model's loss alone.
#pragma once

#include "tp/expert_parallel.h"

#include <torch/torch.h>

#include <meshddp/meshddp.h>
#include <string>

namespace gpt {

struct MlpImpl : torch::nn::Module {
  MlpImpl(int64_t dim, int64_t hidden)
      : fc1(register_module("fc1", meshddp::tp::Linear(dim, hidden))),
        fc2(register_module("fc2", meshddp::tp::Linear(hidden, dim))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::gelu(fc1(x))); }
  meshddp::tp::Linear fc1, fc2;
};
TORCH_MODULE(Mlp);

struct MoeImpl : torch::nn::Module {
  // Builds (and initialises, in order) all `experts` experts, registered as "experts.<global index>".
  MoeImpl(int64_t dim, int64_t hidden, int64_t experts, int64_t top_k)
      : top_k(top_k),
        num_experts(experts),
        router(register_module("router", meshddp::tp::Linear(dim, experts, /*bias=*/false))),
        holder(register_module("experts", std::make_shared<torch::nn::Module>())) {
    for (int64_t e = 0; e < experts; ++e) local.push_back(holder->register_module(std::to_string(e), Mlp(dim, hidden)));
  }
  // Keeps experts [rank * E / size, (rank + 1) * E / size) of this rank of `ep` (kept by pointer; must
  // outlive the model) and drops the others. Call once, before DDP wraps the model; every rank built
  // all E experts from the same seed, so each kept expert has the golden's initial weights.
  void set_expert_parallel(meshddp::tp::Group* group) {
    TORCH_CHECK(!ep, "MoE: set_expert_parallel called twice");
    ep = group;
    const int64_t size = group ? group->getSize() : 1, rank = group ? group->getRank() : 0;
    TORCH_CHECK(num_experts % size == 0, "MoE: ", num_experts, " experts do not divide over ", size, " EP ranks");
    const int64_t per_rank = num_experts / size;
    std::vector<Mlp> kept;
    for (int64_t e = 0; e < num_experts; ++e) {
      if (e / per_rank == rank)
        kept.push_back(local[static_cast<size_t>(e)]);
      else
        holder->unregister_module(std::to_string(e));
    }
    local = kept;
  }
  // x [..., dim] -> [..., dim]: sum over each token's top-k experts of gate * expert(token).
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t dim = x.size(-1);
    auto tokens = x.reshape({-1, dim});  // [N, dim]
    const int64_t n = tokens.size(0);
    auto [gates, chosen] = torch::softmax(router(tokens), -1).topk(top_k, -1);  // [N, k]
    // Assignments (token, slot) grouped by expert, token order kept within an expert (stable sort).
    const auto expert_of = chosen.reshape({-1});
    const auto by_expert = expert_of.argsort(/*stable=*/true);
    const auto route = meshddp::tp::exchange_expert_route(torch::bincount(expert_of, {}, num_experts), ep);
    auto sent = tokens.index_select(0, by_expert.div(top_k, "floor"));  // [N * k, dim]
    auto received = meshddp::tp::all_to_all(sent, route.output_splits, route.input_splits, ep);
    // Each local expert runs on its rows (also on none: its params then get a zero gradient, as DDP
    // expects of every param each step).
    const auto expert_major = torch::tensor(route.expert_major, torch::kLong);
    const auto grouped = received.index_select(0, expert_major).split_with_sizes(route.rows_per_local_expert);
    std::vector<torch::Tensor> outputs;
    for (size_t l = 0; l < local.size(); ++l) outputs.push_back(local[l]->forward(grouped[l]));
    auto processed = torch::cat(outputs).index_select(0, inverse(expert_major));
    auto returned = meshddp::tp::all_to_all(processed, route.input_splits, route.output_splits, ep);
    auto per_slot = returned.index_select(0, inverse(by_expert)).view({n, top_k, dim});  // back in token order
    return (per_slot * gates.unsqueeze(-1)).sum(1).view(x.sizes());
  }
  static torch::Tensor inverse(const torch::Tensor& permutation) {
    return torch::empty_like(permutation).scatter_(0, permutation, torch::arange(permutation.numel()));
  }
  int64_t top_k, num_experts;
  meshddp::tp::Linear router;
  std::shared_ptr<torch::nn::Module> holder;  // "experts": the local experts under their global indices
  std::vector<Mlp> local;                     // the local experts, by ascending global index
  meshddp::tp::Group* ep = nullptr;           // the expert-parallel group (null: all experts here)
};
TORCH_MODULE(Moe);

}  // namespace gpt
