// ddp_bench's vocabulary: a Candidate (one way of training the same model: its step, its memory, its
// extra JSON), the per-step Phases it times with Clock, the Memory it reports, the per-parameter
// gradient-ready ReadyTimeline, the one optimizer every candidate steps, and the small helpers the
// candidates and the report share (median, JSON lists). No communication here.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace bench {

// steady_clock; with --device cuda (set_sync_cuda(true)), now() first waits for the GPU, so every
// phase is GPU time.
struct Clock {
  using time_point = std::chrono::steady_clock::time_point;
  static time_point now();
};
void set_sync_cuda(bool sync);
double ms_since(Clock::time_point a, Clock::time_point b);

double median(std::vector<double> v);  // 0 for an empty vector

// "[1.5, 2]", "[3, 4]", "[\"a\", \"b\"]": JSON lists (numbers with 6 significant digits).
std::string json_num_list(const std::vector<double>& v);
std::string json_int_list(const std::vector<int64_t>& v);
std::string json_str_list(const std::vector<std::string>& v);

// Per-step phase times (ms). sync: the explicit wait after backward (meshddp: finish_grad_sync; naive:
// the per-parameter all-reduces); the Reducer waits inside backward (finalize), so its sync is 0.
struct Phases {
  double fwd = 0, bwd = 0, sync = 0, opt = 0, total = 0;
};
constexpr int kPhases = 5;

struct Memory {
  int64_t grad_and_comm_bytes = 0;  // gradients + communication buffers (distinct storages)
  int64_t optimizer_state_bytes = 0;
  int64_t param_bytes = 0;
};

// Bytes of distinct storages behind a set of tensors (a view shares its base's storage).
int64_t distinct_storage_bytes(const std::vector<at::Tensor>& tensors);
// Bytes of a torch::optim SGD or AdamW optimizer's state.
int64_t optimizer_state_bytes(torch::optim::Optimizer& opt);
// Memory of a candidate whose gradients live in the params' own .grad tensors (local, naive).
Memory plain_grads_memory(const std::vector<at::Tensor>& params, torch::optim::Optimizer& opt);

// The same optimizer for every candidate: SGD (lr 1e-3, momentum 0.9) or AdamW (lr 1e-4, wd 1e-2);
// meshddp_zero1 runs the same arithmetic on its shard.
constexpr double kSgdLr = 1e-3, kSgdMomentum = 0.9, kAdamLr = 1e-4, kAdamWd = 1e-2;
std::shared_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind, std::vector<at::Tensor> params);

// Records when each parameter's gradient arrives (a tensor hook runs just before accumulation),
// relative to the start of backward.
struct ReadyTimeline {
  Clock::time_point bwd_start;             // host times: the hooks must not wait for the GPU
  std::vector<double> current;             // ms, this step
  std::vector<std::vector<double>> steps;  // every recorded step
  std::vector<std::string> names;
  std::vector<int64_t> numels;
  bool recording = false;
  void attach(torch::nn::Module& module);
  void begin_backward() { bwd_start = std::chrono::steady_clock::now(); }
  void end_step() {
    if (recording) steps.push_back(current);
  }
  std::vector<double> medians() const;  // per param, over the recorded steps
};

struct Candidate {
  std::string name;
  std::function<Phases()> step;
  std::function<Memory()> memory;
  std::function<std::string()> extra_json;  // "" or `"key": value, ...`
  std::vector<Phases> timed;                // one per repetition (this rank)
  ReadyTimeline* timeline = nullptr;
  std::vector<int64_t> bucket_numels;  // meshddp: the layout's buckets in launch order
  at::Tensor last_loss;                // this rank's loss of the last step (read once, at the end)
};

}  // namespace bench
