#include "plugin/module_ownership.h"

#include "mesh/placement.h"

#include <c10/util/Exception.h>

#include <map>
#include <mutex>
#include <utility>

namespace meshddp {
namespace {

// "a.b.c" -> "a.b"; "c" -> "".
std::string parent_of(const std::string& name) {
  const auto dot = name.rfind('.');
  return dot == std::string::npos ? "" : name.substr(0, dot);
}

bool is_under(const std::string& name, const std::string& module) {
  return module.empty() ||
         (name.size() > module.size() && name.compare(0, module.size(), module) == 0 && name[module.size()] == '.');
}

// Live claims: TensorImpl -> the name the owning DDP knows the param by. A claim holds the param
// alive (its DDP does), so an address is never reused while it is listed.
std::mutex claims_mutex;
std::map<const void*, std::string>& claims() {
  static std::map<const void*, std::string> map;
  return map;
}

}  // namespace

std::vector<bool> expert_buffer_flags(const std::vector<NamedTensor>& params, const std::vector<NamedTensor>& buffers) {
  std::vector<bool> out;
  out.reserve(buffers.size());
  for (const auto& b : buffers) {
    bool expert = b.tensor.defined() && is_expert_param(b.tensor);
    // Up from the owner to the first module that holds params: it decides.
    for (std::string module = parent_of(b.name); !expert;) {
      int64_t held = 0, experts = 0;
      for (const auto& p : params) {
        if (!p.tensor.defined() || !is_under(p.name, module)) continue;
        ++held;
        experts += is_expert_param(p.tensor) ? 1 : 0;
      }
      if (held > 0) {
        expert = experts == held;
        break;
      }
      if (module.empty()) break;
      module = parent_of(module);
    }
    out.push_back(expert);
  }
  return out;
}

ParamClaim::ParamClaim(const std::vector<NamedTensor>& params) {
  std::lock_guard<std::mutex> lock(claims_mutex);
  auto& map = claims();
  for (const auto& p : params) {
    if (!p.tensor.defined()) continue;
    const auto it = map.find(p.tensor.unsafeGetTensorImpl());
    TORCH_CHECK(it == map.end(), "DistributedDataParallel: parameter '", p.name,
                "' already belongs to a live meshddp DistributedDataParallel (which knows it as '", it->second,
                "'): a model wrapped twice (DistributedDataParallel(DistributedDataParallel(model)), or two wrappers "
                "over one model) would reduce every gradient twice and train on 2x gradients. Wrap the model once; "
                "to wrap it anew, destroy the first wrapper before building the second (C++: reset or let go of it; "
                "Python: del it)");
  }
  for (const auto& p : params) {
    if (!p.tensor.defined()) continue;
    if (map.emplace(p.tensor.unsafeGetTensorImpl(), p.name).second) claimed_.push_back(p.tensor.unsafeGetTensorImpl());
  }
}

ParamClaim::ParamClaim(ParamClaim&& other) noexcept : claimed_(std::move(other.claimed_)) { other.claimed_.clear(); }

ParamClaim& ParamClaim::operator=(ParamClaim&& other) noexcept {
  if (this != &other) {
    release();
    claimed_ = std::move(other.claimed_);
    other.claimed_.clear();
  }
  return *this;
}

void ParamClaim::release() {
  if (claimed_.empty()) return;
  std::lock_guard<std::mutex> lock(claims_mutex);
  for (const void* impl : claimed_) claims().erase(impl);
  claimed_.clear();
}

}  // namespace meshddp
