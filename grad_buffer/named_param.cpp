#include "grad_buffer/named_param.h"

#include <c10/util/Exception.h>

#include <unordered_map>

namespace meshddp {

std::vector<NamedParam> deduplicate_params(std::vector<NamedParam> params) {
  std::vector<NamedParam> unique;
  std::unordered_map<const c10::TensorImpl*, size_t> index_of;
  for (auto& p : params) {
    TORCH_CHECK(p.param.defined(), "GradBuffer: parameter '", p.name, "' is an undefined tensor");
    TORCH_CHECK(p.param.layout() == at::kStrided, "GradBuffer: parameter '", p.name, "' is a ", p.param.layout(),
                " tensor, but meshddp keeps every parameter in a dense flat buffer; make it dense (e.g. ",
                "param.to_dense()) or keep it out of DistributedDataParallel (wrap only the dense part of the model)");
    TORCH_CHECK(!p.param.is_meta(), "GradBuffer: parameter '", p.name, "' is on the meta device (no storage: a model ",
                "built under torch.device(\"meta\") or an empty-weights context); materialize it first (e.g. ",
                "module.to_empty(device=...) and initialize or load its weights), or keep it out of ",
                "DistributedDataParallel");
    const auto [it, inserted] = index_of.emplace(p.param.unsafeGetTensorImpl(), unique.size());
    if (inserted) {
      unique.push_back(std::move(p));
    } else {
      NamedParam& first = unique[it->second];
      first.aliases.push_back(std::move(p.name));
      for (auto& alias : p.aliases) first.aliases.push_back(std::move(alias));
    }
  }
  return unique;
}

std::string describe_param_name(const NamedParam& p) {
  std::string out = "'" + p.name + "'";
  if (p.aliases.empty()) return out;
  out += " (also";
  for (size_t i = 0; i < p.aliases.size(); ++i) out += (i ? ", '" : " '") + p.aliases[i] + "'";
  return out + ")";
}

std::vector<NamedParam> split_trainable_params(std::vector<NamedParam> params, std::vector<NamedParam>& frozen) {
  std::vector<NamedParam> kept;
  for (auto& p : deduplicate_params(std::move(params))) {
    if (!p.param.requires_grad()) {
      frozen.push_back(std::move(p));
      continue;
    }
    TORCH_CHECK(p.param.is_leaf(), "GradBuffer: parameter '", p.name,
                "' requires grad but is not a leaf tensor; register the parameter itself, not a view or result of it");
    kept.push_back(std::move(p));
  }
  return kept;
}

}  // namespace meshddp
