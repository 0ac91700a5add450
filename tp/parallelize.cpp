#include "tp/parallelize.h"

#include "grad_buffer/glob_match.h"
#include "mesh/placement.h"
#include "tp/tp_layers.h"

#include <torch/nn/modules/normalization.h>

#include <sstream>

namespace meshddp {
namespace {

std::string style_name(const TpStyle& style) {
  static const char* names[] = {"ColwiseParallel", "RowwiseParallel",      "VocabParallel",
                                "SequenceSharded", "SequenceParallelNorm", "ExpertParallel"};
  return names[style.index()];
}

void check_divisible(const std::string& path, const TpStyle& style, int64_t size, const std::string& what, int64_t tp) {
  TORCH_CHECK(size % tp == 0, "parallelize: '", path, "' (", style_name(style), ") has ", size, " ", what,
              ", not divisible by the TP size ", tp, "; choose a TP size that divides it");
}

struct Match {
  std::string path;
  std::shared_ptr<torch::nn::Module> module;
  const TpStyle* style;
};

}  // namespace

void parallelize(torch::nn::Module& model, const DeviceMesh& mesh, const std::vector<PlanEntry>& plan,
                 const ParallelizeOptions& options) {
  const auto& group = mesh[options.tp_dim];
  const int64_t tp = group->getSize();
  const bool sp = options.sequence_parallel && tp > 1;

  // 1. Resolve and validate everything before changing anything.
  std::vector<Match> matches;
  std::vector<bool> used(plan.size(), false);
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    for (size_t e = 0; e < plan.size(); ++e) {
      if (!glob_match(plan[e].pattern, item.key())) continue;
      used[e] = true;
      matches.push_back({item.key(), item.value(), &plan[e].style});
      break;  // first matching entry wins
    }
  }
  for (size_t e = 0; e < plan.size(); ++e) {
    TORCH_CHECK(used[e], "parallelize: plan entry '", plan[e].pattern, "' (", style_name(plan[e].style),
                ") matches no module; check the module paths (e.g. model->named_modules())");
  }
  for (const Match& m : matches) {
    const TpStyle& style = *m.style;
    auto wrong_type = [&](const char* expected) {
      return std::string("parallelize: '") + m.path + "' is a " + m.module->name() + ", but " + style_name(style) +
             " applies to a meshddp::tp::" + expected;
    };
    if (const auto* col = std::get_if<ColwiseParallel>(&style)) {
      auto* linear = dynamic_cast<tp::LinearImpl*>(m.module.get());
      TORCH_CHECK(linear, wrong_type("Linear"));
      TORCH_CHECK(col->unit >= 1 && linear->out_features % col->unit == 0, "parallelize: '", m.path, "' has ",
                  linear->out_features, " output features, not a whole number of ", col->unit_name, " of ", col->unit);
      check_divisible(m.path, style, linear->out_features / col->unit, col->unit_name, tp);
    } else if (std::holds_alternative<RowwiseParallel>(style)) {
      auto* linear = dynamic_cast<tp::LinearImpl*>(m.module.get());
      TORCH_CHECK(linear, wrong_type("Linear"));
      check_divisible(m.path, style, linear->in_features, "input features", tp);
    } else if (std::holds_alternative<VocabParallel>(style) || std::holds_alternative<SequenceSharded>(style)) {
      auto* embedding = dynamic_cast<tp::EmbeddingImpl*>(m.module.get());
      TORCH_CHECK(embedding, wrong_type("Embedding"));
      if (std::holds_alternative<VocabParallel>(style)) {
        check_divisible(m.path, style, embedding->num_embeddings, "vocabulary entries", tp);
      }
    } else if (std::holds_alternative<ExpertParallel>(style)) {
      TORCH_CHECK(!m.module->named_parameters(/*recurse=*/true).is_empty(), "parallelize: '", m.path, "' is a ",
                  m.module->name(), " with no parameters; ExpertParallel marks a module's params as expert params, ",
                  "so it applies to a module holding experts' weights");
    } else {
      TORCH_CHECK(!m.module->named_parameters(/*recurse=*/true).is_empty(), "parallelize: '", m.path, "' is a ",
                  m.module->name(), " with no parameters; SequenceParallelNorm marks a module's params as partial ",
                  "over TP, so it applies to a norm-like module that has some");
    }
  }
  if (sp) {
    for (const auto& item : model.named_modules("", false)) {
      const bool layer_norm = dynamic_cast<tp::LayerNormImpl*>(item.value().get()) != nullptr ||
                              dynamic_cast<torch::nn::LayerNormImpl*>(item.value().get()) != nullptr;
      if (!layer_norm) continue;
      bool covered = false;
      for (const Match& m : matches) covered = covered || m.path == item.key();
      TORCH_CHECK(covered, "parallelize: under sequence parallelism every LayerNorm runs on a sequence shard, so '",
                  item.key(),
                  "' must be in the plan (SequenceParallelNorm); its gradient would otherwise be a partial ",
                  "sum over TP that no one sums");
    }
  }

  // 2. Apply.
  c10d::ProcessGroup* g = group.get();
  for (const Match& m : matches) {
    const TpStyle& style = *m.style;
    if (const auto* col = std::get_if<ColwiseParallel>(&style)) {
      dynamic_cast<tp::LinearImpl&>(*m.module).parallelize_colwise(g, sp, col->gather_output);
    } else if (std::holds_alternative<RowwiseParallel>(style)) {
      dynamic_cast<tp::LinearImpl&>(*m.module).parallelize_rowwise(g, sp);
    } else if (std::holds_alternative<VocabParallel>(style)) {
      dynamic_cast<tp::EmbeddingImpl&>(*m.module).parallelize_vocab(g, sp);
    } else if (std::holds_alternative<SequenceSharded>(style)) {
      if (sp) dynamic_cast<tp::EmbeddingImpl&>(*m.module).parallelize_sequence_sharded(g);
    } else if (std::holds_alternative<ExpertParallel>(style)) {
      for (const auto& param : m.module->parameters(/*recurse=*/true)) declare_expert_param(param);
    } else if (sp) {
      for (const auto& param : m.module->parameters(/*recurse=*/true)) {
        set_placement(param, Placement::partial_grad(g->getGroupName()));
      }
    }
  }
}

void declare_sequence_parallel_param(const at::Tensor& param, const DeviceMesh& mesh, const std::string& tp_dim) {
  const auto& group = mesh[tp_dim];
  TORCH_CHECK(param.defined(), "declare_sequence_parallel_param: the param is an undefined tensor");
  const Placement current = get_placement(param);
  TORCH_CHECK(!current.is_shard(), "declare_sequence_parallel_param: the param is already sharded (", current.str(),
              "); only replicated params can have gradients that are partial over TP");
  if (group->getSize() > 1) set_placement(param, Placement::partial_grad(group->getGroupName()));
}

}  // namespace meshddp
