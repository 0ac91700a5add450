#include "tp/expert_parallel.h"

#include "mesh/all_to_all.h"

#include <torch/autograd.h>
#include <torch/torch.h>

#include <numeric>

namespace meshddp::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Its backward is itself with the splits swapped, applied as a Function (Note [Double backward
// through the TP regions] in tp_functions.cpp): so a second-order gradient crosses EP as well.
struct AllToAll : torch::autograd::Function<AllToAll> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, std::vector<int64_t> output_splits,
                            std::vector<int64_t> input_splits, Group* g) {
    ctx->saved_data["group"] = reinterpret_cast<int64_t>(g);
    ctx->saved_data["output_splits"] = output_splits;
    ctx->saved_data["input_splits"] = input_splits;
    const at::Tensor in = x.contiguous();
    std::vector<int64_t> shape = in.sizes().vec();
    shape[0] = std::accumulate(output_splits.begin(), output_splits.end(), int64_t{0});
    at::Tensor out = at::empty(shape, in.options());
    wait_collective(all_to_all_rows(*g, out, in, output_splits, input_splits, "expert-parallel tokens"), *g,
                    "all-to-all of expert-parallel tokens");
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Group* g = reinterpret_cast<Group*>(ctx->saved_data["group"].toInt());
    return {AllToAll::apply(grads[0], ctx->saved_data["input_splits"].toIntVector(),
                            ctx->saved_data["output_splits"].toIntVector(), g),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor all_to_all(const at::Tensor& x, const std::vector<int64_t>& output_splits,
                      const std::vector<int64_t>& input_splits, Group* group) {
  if (group == nullptr || group->getSize() == 1) {
    const std::vector<int64_t> all{x.dim() ? x.size(0) : -1};
    TORCH_CHECK(output_splits == all && input_splits == all, "expert parallel all_to_all on one rank: splits ",
                c10::IntArrayRef(output_splits), " / ", c10::IntArrayRef(input_splits), " must both be {x.size(0)} = {",
                all[0], "}");
    return x;
  }
  return AllToAll::apply(x, output_splits, input_splits, group);
}

ExpertRoute route_to_experts(const std::vector<int64_t>& sent_per_expert, const std::vector<int64_t>& received,
                             int64_t ep_size) {
  const auto experts = static_cast<int64_t>(sent_per_expert.size());
  TORCH_CHECK(ep_size >= 1 && experts >= 1 && experts % ep_size == 0, "expert parallel: ", experts,
              " experts do not divide over an EP group of ", ep_size, " ranks");
  const int64_t local = experts / ep_size;
  TORCH_CHECK(static_cast<int64_t>(received.size()) == ep_size * local, "expert parallel: received counts have ",
              received.size(), " entries, expected EP size ", ep_size, " x experts per rank ", local);
  for (const auto* counts : {&sent_per_expert, &received}) {
    for (int64_t c : *counts) TORCH_CHECK(c >= 0, "expert parallel: negative token count ", c);
  }
  ExpertRoute route;
  route.input_splits.assign(static_cast<size_t>(ep_size), 0);
  route.output_splits.assign(static_cast<size_t>(ep_size), 0);
  route.rows_per_local_expert.assign(static_cast<size_t>(local), 0);
  for (int64_t e = 0; e < experts; ++e) route.input_splits[static_cast<size_t>(e / local)] += sent_per_expert[e];
  std::vector<int64_t> offset(received.size());  // first received row of (source s, local expert l)
  int64_t row = 0;
  for (int64_t s = 0; s < ep_size; ++s) {
    for (int64_t l = 0; l < local; ++l) {
      const auto i = static_cast<size_t>(s * local + l);
      offset[i] = row;
      row += received[i];
      route.output_splits[static_cast<size_t>(s)] += received[i];
      route.rows_per_local_expert[static_cast<size_t>(l)] += received[i];
    }
  }
  route.expert_major.reserve(static_cast<size_t>(row));
  for (int64_t l = 0; l < local; ++l) {
    for (int64_t s = 0; s < ep_size; ++s) {
      const auto i = static_cast<size_t>(s * local + l);
      for (int64_t r = 0; r < received[i]; ++r) route.expert_major.push_back(offset[i] + r);
    }
  }
  return route;
}

ExpertRoute exchange_expert_route(const at::Tensor& sent_per_expert, Group* ep) {
  TORCH_CHECK(sent_per_expert.dim() == 1 && sent_per_expert.scalar_type() == at::kLong,
              "expert parallel: token counts must be a 1-D int64 tensor, got ", sent_per_expert.sizes(), " ",
              sent_per_expert.scalar_type());
  const at::Tensor sent = sent_per_expert.cpu().contiguous();
  const bool trivial = ep == nullptr || ep->getSize() == 1;
  const at::Tensor received =
      trivial ? sent : all_to_all_counts(*ep, sent_per_expert.contiguous(), "expert-parallel token counts").cpu();
  const auto as_vector = [](const at::Tensor& t) {
    return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
  };
  return route_to_experts(as_vector(sent), as_vector(received), trivial ? 1 : ep->getSize());
}

}  // namespace meshddp::tp
