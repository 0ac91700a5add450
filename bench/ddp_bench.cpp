// meshddp benchmark (issue 6): the candidates side by side in one run, on the same model, data and
// ranks, interleaved per repetition (the order rotates every repetition, a barrier before each
// step), warm-up then N repetitions; medians of the step time (per step, the max over ranks) and of
// each phase (per step, the mean over ranks).
//
//   local           the model trained in this rank alone, no DDP (the floor)
//   meshddp         meshddp DDP, bucketed all-reduce overlapped with backward; its layers write their
//                   gradients into the flat buffer (meshddp::linear_with_grad_in_buffer; no zeroing pass)
//   meshddp_autograd the same with torch's Linear and gradient_accumulation_fusion off: gradients added
//                   into the buffer by autograd after a zeroing pass (meshddp before issue 14)
//   meshddp_no_overlap  the same with overlap_grad_reduce=false (every bucket launched in finish_grad_sync)
//   meshddp_zero1   meshddp DDP + ZeRO-1 DistributedOptimizer (reduce-scatter, sharded optimizer, all-gather)
//   reducer_view    c10d::Reducer from the same LibTorch, set up as torch's DDP does, gradient_as_bucket_view=true
//   reducer_copy    the same, gradient_as_bucket_view=false (grads copied into buckets and back)
//   naive           backward, then one blocking all-reduce per parameter, then the step
//   meshddp_bf16    meshddp with the bf16_compress communication hook (grad_buffer/comm_hook.h)
//   reducer_bf16    reducer_view with PyTorch's bf16_compress_hook (Bf16CompressCommHook below)
//   meshddp_fp32_grads  meshddp with grad_reduce_in_fp32 (Megatron's default for bf16): with --dtype bf16,
//                   fp32 main grads and fp32 master weights (Fp32Masters below); for fp32 params = meshddp
//   meshddp_zero1_fp32_grads  meshddp_zero1 with grad_reduce_in_fp32
//
// Every candidate steps the same torch::optim optimizer (--optimizer sgd: momentum 0.9, the default;
// or adamw) except meshddp_zero1*, whose DistributedOptimizer runs the same arithmetic on its shard
// (with fp32 masters for bf16 params), and meshddp_fp32_grads, which steps fp32 masters. With
// --dtype bf16 the others keep bf16 params, grads and optimizer state: the same arithmetic as local.
//
// Models (bench/bench_models.h; --model): mlp, a deep MLP stack (the default, issue 6's runs), or gpt,
// a GPT-style decoder (--layers --hidden --heads --seq --vocab; --batch sequences per rank).
// --preset gpt1b is issue 10's ~1B-parameter bf16 transformer (set_preset in bench/bench_flags.cpp).
//
// --mode main   the candidates, plus per-parameter gradient-ready times, standalone collective times
//               (every bucket size, and a size sweep for the cost model's alpha/beta) and memory
// --mode sweep  meshddp (all-reduce) at several bucket sizes, interleaved, with local as the floor
//
//   torchrun --standalone --nproc-per-node 2 --no-python build/bench/ddp_bench --json out.json
#include "bench/bench_flags.h"
#include "bench/bench_models.h"
#include "mesh/collectives.h"
#include "optimizer/distributed_optimizer.h"
#include "plugin/distributed_data_parallel.h"

#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#ifdef MESHDDP_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace {

using bench::Flags;
using bench::usage_and_exit;

// steady_clock; with --device cuda, now() first waits for the GPU, so every phase is GPU time.
bool g_sync_cuda = false;
struct Clock {
  using time_point = std::chrono::steady_clock::time_point;
  static time_point now() {
#ifdef MESHDDP_WITH_CUDA
    if (g_sync_cuda) c10::cuda::device_synchronize();
#endif
    return std::chrono::steady_clock::now();
  }
};
double ms_since(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// PyTorch's bf16_compress_hook (torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py) for the
// C++ Reducer, which has only FP16CompressCommHook built in. Mirrored step by step: the bucket buffer
// is cast to bf16 (a new tensor), divided in bf16 by the group size (after the cast, as the Python
// hook and FP16CompressCommHook do), all-reduced (SUM) asynchronously on the group, and the future's
// continuation copies the result back into the bucket buffer and returns it (so the Reducer, seeing
// its own buffer, copies nothing more).
class Bf16CompressCommHook : public c10d::CppCommHookInterface<c10::intrusive_ptr<c10d::ProcessGroup>> {
 public:
  using CppCommHookInterface::CppCommHookInterface;
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    at::Tensor compressed = bucket.getBufferRef().to(at::kBFloat16);
    compressed.div_(state_->getSize());
    std::vector<at::Tensor> tensors{compressed};
    auto fut = state_->allreduce(tensors)->getFuture();
    at::Tensor decompressed = bucket.getBufferRef();
    return fut->then(
        [decompressed](c10::ivalue::Future& done) {
          decompressed.copy_(done.value().toTensorVector()[0]);
          return c10::IValue(decompressed);
        },
        c10::TensorType::get());
  }
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

std::string loadavg() {
  std::ifstream in("/proc/loadavg");
  std::string line;
  std::getline(in, line);
  return line;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The model (bench/bench_models.h): every candidate builds its own from the same seed.
bench::ModelOptions model_options(const Flags& f) {
  bench::ModelOptions o;
  o.kind = f.model, o.layers = f.layers, o.hidden = f.hidden, o.heads = f.heads, o.seq = f.seq, o.vocab = f.vocab;
  o.batch = f.batch, o.seed = f.seed;
  o.dtype = f.dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  o.device = f.device == "cuda" ? c10::Device(c10::kCUDA) : c10::Device(c10::kCPU);
  return o;
}

// The same optimizer for every candidate: SGD (lr 1e-3, momentum 0.9) or AdamW (lr 1e-4, wd 1e-2);
// meshddp_zero1 runs the same arithmetic on its shard.
constexpr double kSgdLr = 1e-3, kSgdMomentum = 0.9, kAdamLr = 1e-4, kAdamWd = 1e-2;
std::shared_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind, std::vector<at::Tensor> params) {
  if (kind == "adamw") {
    return std::make_shared<torch::optim::AdamW>(std::move(params),
                                                 torch::optim::AdamWOptions(kAdamLr).weight_decay(kAdamWd));
  }
  return std::make_shared<torch::optim::SGD>(std::move(params), torch::optim::SGDOptions(kSgdLr).momentum(kSgdMomentum));
}

// Bytes of distinct storages behind a set of tensors (a view shares its base's storage).
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

// Memory of a candidate whose gradients live in the params' own .grad tensors (local, naive).
Memory plain_grads_memory(const std::vector<at::Tensor>& params, torch::optim::Optimizer& opt) {
  Memory m;
  std::vector<at::Tensor> grads;
  for (const auto& p : params) grads.push_back(p.grad()), m.param_bytes += p.nbytes();
  m.grad_and_comm_bytes = distinct_storage_bytes(grads);
  m.optimizer_state_bytes = optimizer_state_bytes(opt);
  return m;
}

// Records when each parameter's gradient arrives (a tensor hook runs just before accumulation),
// relative to the start of backward.
struct ReadyTimeline {
  Clock::time_point bwd_start;  // host times: the hooks must not wait for the GPU
  std::vector<double> current;              // ms, this step
  std::vector<std::vector<double>> steps;   // every recorded step
  std::vector<std::string> names;
  std::vector<int64_t> numels;
  bool recording = false;
  void attach(torch::nn::Module& module) {
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
  void begin_backward() { bwd_start = std::chrono::steady_clock::now(); }
  void end_step() {
    if (recording) steps.push_back(current);
  }
  std::vector<double> medians() const {
    std::vector<double> out(current.size(), 0);
    for (size_t p = 0; p < out.size(); ++p) {
      std::vector<double> v;
      for (const auto& s : steps) v.push_back(s[p]);
      out[p] = median(v);
    }
    return out;
  }
};

struct Candidate {
  std::string name;
  std::function<Phases()> step;
  std::function<Memory()> memory;
  std::function<std::string()> extra_json;  // "" or `"key": value, ...`
  std::vector<Phases> timed;                // one per repetition (this rank)
  ReadyTimeline* timeline = nullptr;
  std::vector<int64_t> bucket_numels;       // meshddp: the layout's buckets in launch order
  at::Tensor last_loss;                     // this rank's loss of the last step (read once, at the end)
};

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

// The meshddp layout as JSON: per bucket, its numel (padding included) and its param indices.
std::string layout_json(const meshddp::GradBuffer& buffer) {
  std::ostringstream o;
  o << "[";
  const auto& buckets = buffer.layout().buckets;
  for (size_t b = 0; b < buckets.size(); ++b) {
    o << (b ? ", " : "") << "{\"numel\": " << buckets[b].numel() << ", \"params\": " << json_int_list(buckets[b].params)
      << "}";
  }
  o << "]";
  return o.str();
}

// What a meshddp candidate varies (DdpConfig fields, and the optimizer that goes with them).
struct MeshddpSetup {
  bool zero1 = false;            // use_distributed_optimizer, stepped by meshddp's DistributedOptimizer
  bool overlap = true;           // overlap_grad_reduce
  bool grads_in_buffer = true;   // linear_with_grad_in_buffer + gradient_accumulation_fusion
  std::string comm_hook = meshddp::kNoCommHook;
  bool fp32_grads = false;       // grad_reduce_in_fp32: bf16 params get fp32 main grads (and, without
                                 // zero1, fp32 masters: Fp32Masters); same as meshddp for fp32 params
};

// Megatron's mixed-precision optimizer without ZeRO (Float16OptimizerWithFloat16Params), for
// meshddp_fp32_grads with bf16 params, whose param.grad() DDP releases: an fp32 master copy of every
// param, whose .grad is the param's fp32 main grad (a view of the flat buffer: no copy); torch::optim
// steps the masters (fp32 state), then every param takes its master's value (one cast-copy).
struct Fp32Masters {
  Fp32Masters() = default;
  explicit Fp32Masters(const meshddp::DdpEngine& ddp) {
    for (const auto& p : ddp.named_parameters()) {
      params.push_back(p.param);
      masters.push_back(p.param.detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true).requires_grad_(true));
      main_grads.push_back(ddp.main_grad(p.name));
    }
  }
  void step(torch::optim::Optimizer& opt) {
    for (size_t i = 0; i < masters.size(); ++i) masters[i].mutable_grad() = main_grads[i];
    opt.step();
    torch::NoGradGuard no_grad;
    at::_foreach_copy_(params, masters);
  }
  std::vector<at::Tensor> params, masters, main_grads;
};

struct Bench {
  Flags flags;
  meshddp::DeviceMesh mesh;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  int64_t world = 1, rank = 0;
  bench::ModelOptions model_opts;
  bench::Batch batch;      // this rank's fixed input and target
  int64_t param_numel = 0;

  explicit Bench(Flags f, meshddp::DeviceMesh m) : flags(std::move(f)), mesh(std::move(m)) {
    group = mesh["dp"];
    world = mesh.size("dp");
    rank = mesh.coordinate("dp");
    model_opts = model_options(flags);
    model_opts.device = mesh.device();
    batch = bench::make_batch(model_opts, rank);
  }

  void barrier() { group->barrier()->wait(); }

  std::shared_ptr<bench::BenchModel> make_model() {
    auto model = bench::make_bench_model(model_opts);
    param_numel = 0;
    for (const auto& p : model->parameters()) param_numel += p.numel();
    return model;
  }

  // --- candidates -------------------------------------------------------------------------------

  std::unique_ptr<Candidate> make_local(ReadyTimeline* timeline) {
    auto model = make_model();
    auto opt = make_optimizer(flags.optimizer, model->parameters());
    if (timeline) timeline->attach(*model);
    auto c = std::make_unique<Candidate>();
    c->name = "local";
    c->timeline = timeline;
    c->step = [this, model, opt, timeline, self = c.get()]() mutable {
      Phases p;
      auto t0 = Clock::now();
      opt->zero_grad();  // set_to_none: AccumulateGrad steals the fresh gradient
      auto loss = model->loss(model->forward(batch.input), batch.target);
      self->last_loss = loss.detach();
      auto t1 = Clock::now();
      if (timeline) timeline->begin_backward();
      loss.backward();
      auto t2 = Clock::now();
      opt->step();
      auto t3 = Clock::now();
      if (timeline) timeline->end_step();
      p.fwd = ms_since(t0, t1), p.bwd = ms_since(t1, t2), p.opt = ms_since(t2, t3), p.total = ms_since(t0, t3);
      return p;
    };
    c->memory = [model, opt]() { return plain_grads_memory(model->parameters(), *opt); };
    return c;
  }

  std::unique_ptr<Candidate> make_meshddp(const std::string& name, double bucket_mb, const MeshddpSetup& setup,
                                          ReadyTimeline* timeline) {
    auto model = make_model();
    model->grads_in_buffer = setup.grads_in_buffer;
    meshddp::DdpConfig config;
    config.gradient_accumulation_fusion = setup.grads_in_buffer;
    config.comm_hook = setup.comm_hook;
    config.overlap_grad_reduce = setup.overlap;
    config.grad_reduce_in_fp32 = setup.fp32_grads;
    config.bucket_bytes = static_cast<size_t>(bucket_mb * (1 << 20));
    config.use_distributed_optimizer = setup.zero1;
    auto ddp = std::make_shared<meshddp::DistributedDataParallel<bench::BenchModel>>(model, mesh, "dp", config);
    std::shared_ptr<torch::optim::Optimizer> opt;
    std::shared_ptr<meshddp::DistributedOptimizer> zopt;
    auto masters = std::make_shared<Fp32Masters>();
    if (setup.zero1) {
      meshddp::DistributedOptimizerConfig oc;
      if (flags.optimizer == "adamw") {
        oc.kind = meshddp::OptimizerKind::kAdamW, oc.lr = kAdamLr, oc.weight_decay = kAdamWd;
      } else {
        oc.kind = meshddp::OptimizerKind::kSgd, oc.lr = kSgdLr, oc.momentum = kSgdMomentum;
      }
      oc.overlap_param_gather = false;  // the gather completes inside step(): nothing leaks into the next candidate
      zopt = std::make_shared<meshddp::DistributedOptimizer>(ddp->grad_buffer(), oc);
    } else if (setup.fp32_grads && model_opts.dtype != at::kFloat) {
      *masters = Fp32Masters(*ddp);
      opt = make_optimizer(flags.optimizer, masters->masters);
    } else {
      opt = make_optimizer(flags.optimizer, model->parameters());
    }
    if (timeline) timeline->attach(*model);
    auto c = std::make_unique<Candidate>();
    c->name = name;
    c->timeline = timeline;
    for (const auto& b : ddp->grad_buffer()->layout().buckets) c->bucket_numels.push_back(b.numel());
    auto hooks = std::make_shared<std::vector<double>>();
    c->step = [this, model, ddp, opt, zopt, masters, timeline, hooks, self = c.get()]() {
      Phases p;
      auto t0 = Clock::now();
      ddp->zero_grad_buffer();
      auto loss = model->loss(ddp->forward(batch.input), batch.target);
      self->last_loss = loss.detach();
      auto t1 = Clock::now();
      if (timeline) timeline->begin_backward();
      loss.backward();
      auto t2 = Clock::now();
      ddp->finish_grad_sync();  // exposed communication: end of backward -> here
      auto t3 = Clock::now();
      hooks->push_back(static_cast<double>(ddp->grad_buffer()->stats().buckets_launched_by_hooks));
      if (zopt) {
        zopt->step();
      } else if (!masters->masters.empty()) {
        masters->step(*opt);
      } else {
        opt->step();
      }
      auto t4 = Clock::now();
      if (timeline) timeline->end_step();
      p.fwd = ms_since(t0, t1), p.bwd = ms_since(t1, t2), p.sync = ms_since(t2, t3), p.opt = ms_since(t3, t4);
      p.total = ms_since(t0, t4);
      return p;
    };
    c->memory = [model, ddp, opt, zopt, masters]() {
      Memory m;
      std::vector<at::Tensor> grads;
      for (const auto& p : model->parameters()) grads.push_back(p.grad()), m.param_bytes += p.nbytes();
      const meshddp::GradBuffer& buffer = ddp->grad_buffer();
      for (size_t i = 0; i < buffer.layout().buffers.size(); ++i) grads.push_back(buffer.buffer(static_cast<int64_t>(i)));
      m.grad_and_comm_bytes = distinct_storage_bytes(grads);
      if (zopt) {
        const auto r = zopt->memory();
        m.optimizer_state_bytes = r.optimizer_state_bytes + r.master_weight_bytes + r.grad_scratch_bytes;
        m.param_bytes = r.param_buffer_bytes;
      } else {
        m.optimizer_state_bytes = optimizer_state_bytes(*opt) + distinct_storage_bytes(masters->masters);
      }
      return m;
    };
    c->extra_json = [ddp, hooks, bucket_mb]() {
      std::ostringstream o;
      o << "\"bucket_mb\": " << bucket_mb << ", \"buckets\": " << ddp->grad_buffer()->layout().buckets.size()
        << ", \"buckets_launched_by_hooks_median\": " << median(*hooks)
        << ", \"layout\": " << layout_json(ddp->grad_buffer());
      return o.str();
    };
    return c;
  }

  std::unique_ptr<Candidate> make_reducer(bool view, bool bf16 = false) {
    auto model = make_model();
    // Broadcast rank 0's params like torch DDP's init sync (they are already equal: same seed).
    std::vector<at::Tensor> params;
    std::unordered_map<size_t, std::string> names;
    for (auto& item : model->named_parameters()) {
      names[params.size()] = item.key();
      params.push_back(item.value());
    }
    // torch DDP (find_unused_parameters=False): the first iteration uses one bucket (limit SIZE_MAX);
    // rebuild_buckets() before the second forward re-buckets in gradient-ready order with caps
    // [first_bucket_bytes_cap, bucket_bytes_cap]. Bucket lists are passed reversed.
    auto [indices, limits] = c10d::compute_bucket_assignment_by_size(
        params, {std::numeric_limits<size_t>::max()}, std::vector<bool>(params.size(), false));
    std::reverse(indices.begin(), indices.end());
    const int64_t cap = static_cast<int64_t>(flags.bucket_mb * (1 << 20));
    const int64_t first_cap = static_cast<int64_t>(flags.reducer_first_bucket_mb * (1 << 20));
    auto reducer = std::make_shared<c10d::Reducer>(params, indices, group, std::vector<bool>(params.size(), false), cap,
                                                   /*find_unused_parameters=*/false, /*gradient_as_bucket_view=*/view,
                                                   names, first_cap, /*skip_all_reduce_unused_params=*/false,
                                                   /*use_python_reducer=*/false, std::vector<int64_t>{});
    if (bf16) reducer->register_comm_hook(std::make_unique<Bf16CompressCommHook>(group));
    auto opt = make_optimizer(flags.optimizer, model->parameters());
    auto c = std::make_unique<Candidate>();
    c->name = bf16 ? "reducer_bf16" : view ? "reducer_view" : "reducer_copy";
    c->step = [this, model, reducer, opt, view, self = c.get()]() mutable {
      Phases p;
      auto t0 = Clock::now();
      // With gradient_as_bucket_view the grads are bucket views: zero them in place (set_to_none would
      // make AccumulateGrad allocate and the hook copy). Without it, torch's default set_to_none.
      if (view) {
        // torch::optim's zero_grad(false) calls detach_(), which views refuse; zero in place like
        // Python's Optimizer.zero_grad(set_to_none=False) does.
        torch::NoGradGuard no_grad;
        for (auto& param : model->parameters()) {
          if (param.grad().defined()) param.mutable_grad().zero_();
        }
      } else {
        opt->zero_grad();
      }
      reducer->prepare_for_forward();
      reducer->rebuild_buckets();  // does something once, before the second forward
      auto loss = model->loss(model->forward(batch.input), batch.target);
      self->last_loss = loss.detach();
      reducer->prepare_for_backward({});
      auto t1 = Clock::now();
      loss.backward();  // buckets all-reduce from the hooks; finalize (wait + copy back) runs at the end
      auto t2 = Clock::now();
      opt->step();
      auto t3 = Clock::now();
      p.fwd = ms_since(t0, t1), p.bwd = ms_since(t1, t2), p.opt = ms_since(t2, t3), p.total = ms_since(t0, t3);
      return p;
    };
    c->memory = [model, reducer, opt]() {
      Memory m;
      std::vector<at::Tensor> tensors;
      for (const auto& p : model->parameters()) tensors.push_back(p.grad()), m.param_bytes += p.nbytes();
      for (const auto& b : reducer->get_grad_buckets(/*return_zero_tensors=*/false)) tensors.push_back(b.getBuffer());
      m.grad_and_comm_bytes = distinct_storage_bytes(tensors);
      m.optimizer_state_bytes = optimizer_state_bytes(*opt);
      return m;
    };
    c->extra_json = [reducer]() {
      auto buckets = reducer->get_grad_buckets(false);
      std::vector<int64_t> numels;
      for (const auto& b : buckets) numels.push_back(b.getBuffer().numel());
      std::ostringstream o;
      o << "\"buckets\": " << buckets.size() << ", \"bucket_numels\": " << json_int_list(numels);
      return o.str();
    };
    return c;
  }

  std::unique_ptr<Candidate> make_naive() {
    auto model = make_model();
    auto opt = make_optimizer(flags.optimizer, model->parameters());
    auto c = std::make_unique<Candidate>();
    c->name = "naive";
    c->step = [this, model, opt, self = c.get()]() mutable {
      Phases p;
      auto t0 = Clock::now();
      opt->zero_grad();
      auto loss = model->loss(model->forward(batch.input), batch.target);
      self->last_loss = loss.detach();
      auto t1 = Clock::now();
      loss.backward();
      auto t2 = Clock::now();
      for (auto& param : model->parameters()) {
        auto g = param.mutable_grad();
        g.div_(static_cast<double>(world));
        meshddp::all_reduce_sum_now(*group, g, "naive per-parameter all-reduce");
      }
      auto t3 = Clock::now();
      opt->step();
      auto t4 = Clock::now();
      p.fwd = ms_since(t0, t1), p.bwd = ms_since(t1, t2), p.sync = ms_since(t2, t3), p.opt = ms_since(t3, t4);
      p.total = ms_since(t0, t4);
      return p;
    };
    c->memory = [model, opt]() { return plain_grads_memory(model->parameters(), *opt); };
    return c;
  }

  // --- running ----------------------------------------------------------------------------------

  // Warm-up, then reps; every repetition runs each candidate once, in an order rotated per repetition.
  // Returns per candidate, per rep, the phases as the max over ranks.
  std::vector<std::vector<Phases>> run(std::vector<std::unique_ptr<Candidate>>& cands) {
    const size_t n = cands.size();
    for (int w = 0; w < flags.warmup; ++w) {
      for (auto& c : cands) {
        barrier();
        c->step();
      }
    }
    for (auto& c : cands) {
      if (c->timeline) c->timeline->recording = true;
    }
    for (int r = 0; r < flags.reps; ++r) {
      for (size_t k = 0; k < n; ++k) {
        auto& c = cands[(k + static_cast<size_t>(r)) % n];
        barrier();
        c->timed.push_back(c->step());
      }
      if (rank == 0) {
        std::fprintf(stderr, "# rep %d/%d done\n", r + 1, flags.reps);
      }
    }
    for (auto& c : cands) {
      if (c->timeline) c->timeline->recording = false;
    }
    // Max over ranks, per step and phase.
    auto t = torch::zeros({static_cast<int64_t>(n), flags.reps, kPhases}, torch::kDouble);
    auto acc = t.accessor<double, 3>();
    for (size_t i = 0; i < n; ++i) {
      for (int r = 0; r < flags.reps; ++r) {
        const Phases& p = cands[i]->timed[r];
        const double v[kPhases] = {p.fwd, p.bwd, p.sync, p.opt, p.total};
        for (int k = 0; k < kPhases; ++k) acc[i][r][k] = v[k];
      }
    }
    // A step takes as long as its slowest rank: total = max over ranks. The phases are the mean over
    // ranks (per-phase maxima would come from different ranks and add up to more than the step).
    auto tmax = t.clone();
    std::vector<at::Tensor> ts{tmax};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::MAX;
    group->allreduce(ts, o)->wait();
    std::vector<at::Tensor> tsum{t};
    group->allreduce(tsum)->wait();
    t.div_(static_cast<double>(world));
    auto amax = tmax.accessor<double, 3>();
    std::vector<std::vector<Phases>> out(n);
    for (size_t i = 0; i < n; ++i) {
      for (int r = 0; r < flags.reps; ++r) {
        out[i].push_back(Phases{acc[i][r][0], acc[i][r][1], acc[i][r][2], acc[i][r][3], amax[i][r][4]});
      }
    }
    return out;
  }

  // Median time (max over ranks) of a standalone collective on a fresh buffer of `numel` fp32.
  double time_collective(int64_t numel, const std::string& kind) {
    auto buf = torch::ones({numel}, mesh.device());
    auto shard = torch::empty({numel / world}, mesh.device());
    std::vector<double> times;
    for (int r = 0; r < flags.collective_reps + 1; ++r) {
      barrier();
      auto t0 = Clock::now();
      if (kind == "all_reduce") {
        meshddp::all_reduce_sum_now(*group, buf, "standalone all-reduce");
      } else if (kind == "reduce_scatter") {
        auto w = meshddp::reduce_scatter_sum(*group, shard, buf.narrow(0, 0, shard.numel() * world), "standalone rs");
        meshddp::wait_collective(w, *group, "standalone rs");
      } else {
        auto w = meshddp::all_gather_into(*group, buf.narrow(0, 0, shard.numel() * world), shard, "standalone ag");
        meshddp::wait_collective(w, *group, "standalone ag");
      }
      auto t1 = Clock::now();
      if (r > 0) times.push_back(ms_since(t0, t1));  // the first is a warm-up
    }
    auto t = torch::tensor(times, torch::kDouble);
    std::vector<at::Tensor> ts{t};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::MAX;
    group->allreduce(ts, o)->wait();
    return median(std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel()));
  }
};

std::string phases_json(const std::vector<Phases>& v) {
  std::vector<double> fwd, bwd, sync, opt, total;
  for (const auto& p : v) {
    fwd.push_back(p.fwd), bwd.push_back(p.bwd), sync.push_back(p.sync), opt.push_back(p.opt), total.push_back(p.total);
  }
  std::ostringstream o;
  o.precision(6);
  o << "\"median_ms\": {\"fwd\": " << median(fwd) << ", \"bwd\": " << median(bwd) << ", \"sync\": " << median(sync)
    << ", \"opt\": " << median(opt) << ", \"total\": " << median(total) << "}, \"total_ms\": " << json_num_list(total)
    << ", \"sync_ms\": " << json_num_list(sync);
  return o.str();
}

double median_total(const std::vector<Phases>& v) {
  std::vector<double> t;
  for (const auto& p : v) t.push_back(p.total);
  return median(t);
}

}  // namespace

int main(int argc, char** argv) {
  const Flags flags = bench::parse_flags(argc, argv);
  try {
    const std::string load_start = loadavg();
    const char* local_world = std::getenv("LOCAL_WORLD_SIZE");
    const int ranks_here = local_world ? std::max(1, std::atoi(local_world)) : 1;
    const int threads = flags.threads > 0
                            ? flags.threads
                            : static_cast<int>(std::max(1u, std::thread::hardware_concurrency() / ranks_here));
    at::set_num_threads(threads);

    const int64_t world = std::getenv("WORLD_SIZE") ? std::atoll(std::getenv("WORLD_SIZE")) : 1;
    meshddp::MeshOptions mesh_options;
    if (flags.device == "cuda") {
      mesh_options.device_type = c10::DeviceType::CUDA;  // NCCL groups on cuda:LOCAL_RANK
      g_sync_cuda = true;
    }
    Bench bench(flags, meshddp::DeviceMesh::from_env({world, 1}, {"dp", "tp"}, mesh_options));
    const bool root = bench.rank == 0;

    std::vector<std::unique_ptr<Candidate>> cands;
    ReadyTimeline local_timeline, meshddp_timeline;
    if (flags.mode == "main") {
      const double mb = flags.bucket_mb;
      for (const auto& name : split(flags.candidates)) {
        if (name == "local") cands.push_back(bench.make_local(&local_timeline));
        else if (name == "meshddp") cands.push_back(bench.make_meshddp(name, mb, {}, &meshddp_timeline));
        else if (name == "meshddp_no_overlap") cands.push_back(bench.make_meshddp(name, mb, {.overlap = false}, nullptr));
        else if (name == "meshddp_zero1") cands.push_back(bench.make_meshddp(name, mb, {.zero1 = true}, nullptr));
        else if (name == "meshddp_autograd")  // before issue 14: torch's Linear, gradients added by autograd, zeroing pass
          cands.push_back(bench.make_meshddp(name, mb, {.grads_in_buffer = false}, nullptr));
        else if (name == "meshddp_fp32_grads") cands.push_back(bench.make_meshddp(name, mb, {.fp32_grads = true}, nullptr));
        else if (name == "meshddp_zero1_fp32_grads")
          cands.push_back(bench.make_meshddp(name, mb, {.zero1 = true, .fp32_grads = true}, nullptr));
        else if (name == "reducer_view") cands.push_back(bench.make_reducer(true));
        else if (name == "reducer_copy") cands.push_back(bench.make_reducer(false));
        else if (name == "naive") cands.push_back(bench.make_naive());
        else if (name == "meshddp_bf16")
          cands.push_back(bench.make_meshddp(name, mb, {.comm_hook = meshddp::kBf16CompressHook}, nullptr));
        else if (name == "meshddp_zero1_bf16")
          cands.push_back(bench.make_meshddp(name, mb, {.zero1 = true, .comm_hook = meshddp::kBf16CompressHook}, nullptr));
        else if (name == "reducer_bf16") cands.push_back(bench.make_reducer(true, /*bf16=*/true));
        else usage_and_exit(argv[0], "unknown candidate " + name);
      }
    } else {
      cands.push_back(bench.make_local(&local_timeline));  // the cost model's input for this run
      for (const auto& mb : split(flags.sweep_mb)) {
        cands.push_back(bench.make_meshddp("meshddp_" + mb + "MiB", std::stod(mb), {}, nullptr));
      }
    }
    const int64_t numel = bench.param_numel;
    if (root) {
      const bool gpt = flags.model == "gpt";
      std::printf("# meshddp bench (%s%s%s): %s, %s = %lld params (%.1f MB), batch %lld %s per rank, %s, %d intra-op "
                  "thread(s) per rank, %d warm-up + %d reps\n# loadavg at start: %s\n",
                  flags.mode.c_str(), flags.preset.empty() ? "" : ", preset ", flags.preset.c_str(),
                  bench.mesh.describe().c_str(), bench::describe(bench.model_opts).c_str(), static_cast<long long>(numel),
                  numel * c10::elementSize(bench.model_opts.dtype) / 1e6, static_cast<long long>(flags.batch),
                  gpt ? ("sequences of " + std::to_string(flags.seq) + " tokens").c_str() : "rows", flags.optimizer.c_str(),
                  threads, flags.warmup, flags.reps, load_start.c_str());
      std::fflush(stdout);
    }

    const auto results = bench.run(cands);
    std::map<std::string, double> med;
    for (size_t i = 0; i < cands.size(); ++i) med[cands[i]->name] = median_total(results[i]);

    // Memory after the runs (buffers and optimizer state exist).
    std::vector<Memory> mems;
    for (auto& c : cands) mems.push_back(c->memory());

    // Standalone collectives: meshddp's bucket sizes (all-reduce; ZeRO-1: reduce-scatter + all-gather)
    // and a size sweep for alpha/beta.
    std::ostringstream coll;
    std::vector<double> bucket_ar_ms, bucket_rs_ms, bucket_ag_ms;
    std::vector<int64_t> bucket_numels, zero_numels;
    if (flags.mode == "main" && flags.collective_reps > 0) {
      for (const auto& c : cands) {
        if (c->name == "meshddp" || (c->name == "meshddp_no_overlap" && bucket_numels.empty())) bucket_numels = c->bucket_numels;
        if (c->name == "meshddp_zero1") zero_numels = c->bucket_numels;
      }
      for (int64_t n : bucket_numels) bucket_ar_ms.push_back(bench.time_collective(n, "all_reduce"));
      for (int64_t n : zero_numels) bucket_rs_ms.push_back(bench.time_collective(n, "reduce_scatter"));
      for (int64_t n : zero_numels) bucket_ag_ms.push_back(bench.time_collective(n, "all_gather"));
      std::vector<int64_t> sweep_bytes;
      std::vector<double> sweep_ms;
      for (int64_t bytes = 4 << 10; bytes <= (64 << 20); bytes *= 4) {
        sweep_bytes.push_back(bytes);
        sweep_ms.push_back(bench.time_collective(bytes / 4, "all_reduce"));
      }
      coll << "\"collectives\": {\"bucket_numels\": " << json_int_list(bucket_numels)
           << ", \"bucket_all_reduce_ms\": " << json_num_list(bucket_ar_ms)
           << ", \"zero1_bucket_numels\": " << json_int_list(zero_numels)
           << ", \"zero1_bucket_reduce_scatter_ms\": " << json_num_list(bucket_rs_ms)
           << ", \"zero1_bucket_all_gather_ms\": " << json_num_list(bucket_ag_ms)
           << ", \"all_reduce_sweep_bytes\": " << json_int_list(sweep_bytes)
           << ", \"all_reduce_sweep_ms\": " << json_num_list(sweep_ms) << "},\n";
    }
    const std::string load_end = loadavg();
    std::vector<double> losses;  // this rank's loss at the last step: the candidates train the same model
    for (auto& c : cands) losses.push_back(c->last_loss.item<double>());  // every candidate ran >= 1 step

    if (root) {
      std::printf("\n%-24s %9s %9s %9s %9s %9s %10s  %s\n", "candidate", "step_ms", "fwd", "bwd", "sync", "opt",
                  "last_loss", "grad+comm MB / opt-state MB");
      for (size_t i = 0; i < cands.size(); ++i) {
        std::vector<double> f, b, s, o;
        for (const auto& p : results[i]) f.push_back(p.fwd), b.push_back(p.bwd), s.push_back(p.sync), o.push_back(p.opt);
        std::printf("%-24s %9.1f %9.1f %9.1f %9.1f %9.1f %10.6f  %.1f / %.1f\n", cands[i]->name.c_str(),
                    med[cands[i]->name], median(f), median(b), median(s), median(o), losses[i],
                    mems[i].grad_and_comm_bytes / 1e6, mems[i].optimizer_state_bytes / 1e6);
      }
      auto ratio = [&](const char* a, const char* b) {
        if (med.count(a) && med.count(b) && med[b] > 0) std::printf("  %s / %s = %.3f\n", a, b, med[a] / med[b]);
      };
      std::printf("\nratios of median step time:\n");
      for (const auto& c : cands) {
        if (c->name != "local") ratio(c->name.c_str(), "local");
      }
      for (const char* base : {"reducer_view", "reducer_copy", "naive"}) ratio("meshddp", base);
      ratio("meshddp_zero1", "reducer_view");
      ratio("meshddp_zero1", "meshddp");
      ratio("meshddp_fp32_grads", "meshddp");
      ratio("meshddp_bf16", "reducer_bf16");
      if (!bucket_ar_ms.empty()) {
        double sum = 0;
        for (double v : bucket_ar_ms) sum += v;
        std::printf("\nstandalone bucket all-reduces (meshddp layout, %zu buckets): sum %.1f ms, last bucket %.1f ms\n",
                    bucket_ar_ms.size(), sum, bucket_ar_ms.back());
      }
      if (flags.mode == "sweep") {
        std::printf("\n(sweep) step time vs bucket size; default is 40 MiB\n");
      }
      std::printf("# loadavg at end: %s\n", load_end.c_str());

      if (!flags.json.empty()) {
        std::ofstream out(flags.json);
        out.precision(8);
        out << "{\n\"mode\": \"" << flags.mode << "\",\n\"world\": " << bench.world << ",\n\"threads_per_rank\": "
            << threads << ",\n\"device\": \"" << bench.mesh.device() << "\",\n\"preset\": \"" << flags.preset
            << "\",\n\"model\": \"" << flags.model << "\",\n\"dtype\": \"" << flags.dtype << "\",\n\"layers\": "
            << flags.layers << ",\n\"hidden\": " << flags.hidden;
        if (flags.model == "gpt") out << ",\n\"heads\": " << flags.heads << ",\n\"seq\": " << flags.seq << ",\n\"vocab\": " << flags.vocab;
        out
            << ",\n\"batch_per_rank\": " << flags.batch << ",\n\"params\": " << numel << ",\n\"warmup\": " << flags.warmup
            << ",\n\"reps\": " << flags.reps << ",\n\"optimizer\": \"" << flags.optimizer << "\"" << ",\n\"bucket_mb\": " << flags.bucket_mb
            << ",\n\"reducer_first_bucket_mb\": " << flags.reducer_first_bucket_mb << ",\n\"loadavg_start\": \""
            << load_start << "\",\n\"loadavg_end\": \"" << load_end << "\",\n\"hardware_concurrency\": "
            << std::thread::hardware_concurrency() << ",\n" << coll.str();
        for (auto* tl : {&local_timeline, &meshddp_timeline}) {
          if (tl->steps.empty()) continue;
          out << "\"" << (tl == &local_timeline ? "local" : "meshddp") << "_grad_ready_ms\": {\"names\": "
              << json_str_list(tl->names) << ", \"numels\": " << json_int_list(tl->numels)
              << ", \"ready_ms\": " << json_num_list(tl->medians()) << "},\n";
        }
        out << "\"candidates\": [\n";
        for (size_t i = 0; i < cands.size(); ++i) {
          out << "  {\"name\": \"" << cands[i]->name << "\", " << phases_json(results[i])
              << ", \"grad_and_comm_bytes\": " << mems[i].grad_and_comm_bytes
              << ", \"optimizer_state_bytes\": " << mems[i].optimizer_state_bytes
              << ", \"param_bytes\": " << mems[i].param_bytes << ", \"last_loss\": " << losses[i];
          if (cands[i]->extra_json) out << ", " << cands[i]->extra_json();
          out << "}" << (i + 1 < cands.size() ? "," : "") << "\n";
        }
        out << "]\n}\n";
        std::printf("# wrote %s\n", flags.json.c_str());
      }
    }
  } catch (const c10::Error& e) {
    std::cerr << "ddp_bench: " << e.what_without_backtrace() << std::endl;
    return 1;
  }
  return 0;
}
