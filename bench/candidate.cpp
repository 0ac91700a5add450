#include "bench/candidate.h"

#include <algorithm>
#include <set>
#include <sstream>

#ifdef MESHDDP_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace bench {
namespace {
bool g_sync_cuda = false;
}  // namespace

Clock::time_point Clock::now() {
#ifdef MESHDDP_WITH_CUDA
  if (g_sync_cuda) c10::cuda::device_synchronize();
#endif
  return std::chrono::steady_clock::now();
}

void set_sync_cuda(bool sync) { g_sync_cuda = sync; }

double ms_since(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string json_num_list(const std::vector<double>& v) {
  std::ostringstream o;
  o.precision(6);
  o << "[";
  for (size_t i = 0; i < v.size(); ++i) o << (i ? ", " : "") << v[i];
  o << "]";
  return o.str();
}

std::string json_int_list(const std::vector<int64_t>& v) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < v.size(); ++i) o << (i ? ", " : "") << v[i];
  o << "]";
  return o.str();
}

std::string json_str_list(const std::vector<std::string>& v) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < v.size(); ++i) o << (i ? ", " : "") << '"' << v[i] << '"';
  o << "]";
  return o.str();
}

int64_t distinct_storage_bytes(const std::vector<at::Tensor>& tensors) {
  std::set<const void*> seen;
  int64_t bytes = 0;
  for (const auto& t : tensors) {
    if (!t.defined()) continue;
    const void* key = t.storage().unsafeGetStorageImpl();
    if (seen.insert(key).second) bytes += static_cast<int64_t>(t.storage().nbytes());
  }
  return bytes;
}

int64_t optimizer_state_bytes(torch::optim::Optimizer& opt) {
  int64_t bytes = 0;
  for (const auto& [key, state] : opt.state()) {
    if (auto* a = dynamic_cast<torch::optim::AdamWParamState*>(state.get())) {
      for (const auto* t : {&a->exp_avg(), &a->exp_avg_sq(), &a->max_exp_avg_sq()}) {
        if (t->defined()) bytes += t->numel() * t->element_size();
      }
    } else if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(state.get())) {
      if (s->momentum_buffer().defined()) bytes += s->momentum_buffer().nbytes();
    }
  }
  return bytes;
}

Memory plain_grads_memory(const std::vector<at::Tensor>& params, torch::optim::Optimizer& opt) {
  Memory m;
  std::vector<at::Tensor> grads;
  for (const auto& p : params) grads.push_back(p.grad()), m.param_bytes += p.nbytes();
  m.grad_and_comm_bytes = distinct_storage_bytes(grads);
  m.optimizer_state_bytes = optimizer_state_bytes(opt);
  return m;
}

std::shared_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind, std::vector<at::Tensor> params) {
  if (kind == "adamw") {
    return std::make_shared<torch::optim::AdamW>(std::move(params),
                                                 torch::optim::AdamWOptions(kAdamLr).weight_decay(kAdamWd));
  }
  return std::make_shared<torch::optim::SGD>(std::move(params),
                                             torch::optim::SGDOptions(kSgdLr).momentum(kSgdMomentum));
}

void ReadyTimeline::attach(torch::nn::Module& module) {
  auto named = module.named_parameters();
  current.assign(named.size(), 0);
  int64_t i = 0;
  for (auto& item : named) {
    names.push_back(item.key());
    numels.push_back(item.value().numel());
    const int64_t index = i++;
    item.value().register_hook([this, index](const at::Tensor&) {
      if (recording) current[index] = ms_since(bwd_start, std::chrono::steady_clock::now());
    });
  }
}

std::vector<double> ReadyTimeline::medians() const {
  std::vector<double> out(current.size(), 0);
  for (size_t p = 0; p < out.size(); ++p) {
    std::vector<double> v;
    for (const auto& s : steps) v.push_back(s[p]);
    out[p] = median(v);
  }
  return out;
}

}  // namespace bench
