// ddp_bench's candidates: each builds its own model from the seed and returns a Candidate whose step
// runs one training step the candidate's way (bench/ddp_bench.cpp's header lists them), timing its
// phases, and whose memory reports what it holds. Also PyTorch's bf16 compression hook for the C++
// Reducer and the fp32 masters of meshddp_fp32_grads.
#include "bench/bench.h"
#include "grad_buffer/grad_buffer.h"
#include "mesh/collectives.h"
#include "optimizer/distributed_optimizer.h"
#include "plugin/distributed_data_parallel.h"

#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <algorithm>
#include <limits>
#include <sstream>
#include <unordered_map>

namespace bench {
namespace {

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

// The bytes one step hands to the collectives of each group, summed over the buckets every step
// launches (all of them), and what a ring sends per rank for them ((p-1)/p of a reduce-scatter's
// input or an all-gather's output, twice that for an all-reduce): the gradient reduction over the
// DP group (its instance with hierarchical ZeRO-1; TP-partial buckets over the mesh), the shards'
// all-reduce across instances, and ZeRO-1's param all-gather. Counted from the layout the buffer
// launches, not from NIC counters.
std::string group_bytes_json(const meshddp::GradBuffer& buffer) {
  const auto& layout = buffer.layout();
  const meshddp::SyncGroups& g = buffer.groups();
  const bool zero1 = buffer.config().use_distributed_optimizer;
  int64_t reduce = 0, partial = 0, cross = 0, gather = 0;
  for (const auto& span : layout.buckets) {
    const auto& key = layout.buffers[span.buffer].key;
    const auto grad = static_cast<int64_t>(span.numel() * c10::elementSize(key.grad_dtype));
    (key.tp_partial ? partial : reduce) += grad;
    if (g.cross_instance && !key.tp_partial) cross += grad / g.dp_size();  // buckets are padded to dp_size
    if (zero1) gather += static_cast<int64_t>(span.numel() * c10::elementSize(key.param_dtype));
  }
  std::ostringstream o;
  auto entry = [&](const char* name, const c10d::ProcessGroup* group, const char* kind, int64_t bytes, int64_t ring) {
    const int64_t p = group ? group->getSize() : 1;
    o << "\"" << name << "\": {\"group\": \"" << (group ? meshddp::describe_group(*group) : "none")
      << "\", \"ranks\": " << p << ", \"collective\": \"" << kind << "\", \"bytes\": " << bytes
      << ", \"ring_bytes_per_rank\": " << ring * (p - 1) * bytes / p << "}";
  };
  o << "{";
  entry("grad_reduce", g.dp.get(), zero1 ? "reduce-scatter" : "all-reduce", reduce, zero1 ? 1 : 2);
  o << ", ";
  entry("grad_reduce_tp_partial", g.world.get(), "all-reduce", partial, 2);
  o << ", ";
  entry("across_instances", g.cross_instance.get(), "all-reduce", cross, 2);
  o << ", ";
  entry("param_all_gather", g.dp.get(), "all-gather", gather, 1);
  o << "}";
  return o.str();
}

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

meshddp::DdpConfig ddp_config(const MeshddpSetup& setup, double bucket_mb) {
  meshddp::DdpConfig config;
  config.gradient_accumulation_fusion = setup.grads_in_buffer;
  config.comm_hook = setup.comm_hook;
  config.overlap_grad_reduce = setup.overlap;
  config.grad_reduce_in_fp32 = setup.fp32_grads;
  config.bucket_bytes = static_cast<size_t>(bucket_mb * (1 << 20));
  config.use_distributed_optimizer = setup.zero1;
  config.num_distributed_optimizer_instances = setup.instances;
  return config;
}

// The DistributedOptimizer running the arithmetic of make_optimizer(`kind`) on its shard.
meshddp::DistributedOptimizerConfig zero1_config(const std::string& kind) {
  meshddp::DistributedOptimizerConfig oc;
  if (kind == "adamw") {
    oc.kind = meshddp::OptimizerKind::kAdamW, oc.lr = kAdamLr, oc.weight_decay = kAdamWd;
  } else {
    oc.kind = meshddp::OptimizerKind::kSgd, oc.lr = kSgdLr, oc.momentum = kSgdMomentum;
  }
  oc.overlap_param_gather = false;  // the gather completes inside step(): nothing leaks into the next candidate
  return oc;
}

// A meshddp candidate's memory: its grads and flat buffers; the ZeRO-1 optimizer's report, or the
// torch optimizer's state plus any fp32 masters. `opt` is null with ZeRO-1, `zopt` without.
Memory meshddp_memory(BenchModel& model, meshddp::DdpEngine& ddp, torch::optim::Optimizer* opt,
                      meshddp::DistributedOptimizer* zopt, const Fp32Masters& masters) {
  Memory m;
  std::vector<at::Tensor> grads;
  for (const auto& p : model.parameters()) grads.push_back(p.grad()), m.param_bytes += p.nbytes();
  const meshddp::GradBuffer& buffer = ddp.grad_buffer();
  for (size_t i = 0; i < buffer.layout().buffers.size(); ++i) grads.push_back(buffer.buffer(static_cast<int64_t>(i)));
  m.grad_and_comm_bytes = distinct_storage_bytes(grads);
  if (zopt) {
    const auto r = zopt->memory();
    m.optimizer_state_bytes = r.optimizer_state_bytes + r.master_weight_bytes + r.grad_scratch_bytes;
    m.param_bytes = r.param_buffer_bytes;
  } else {
    m.optimizer_state_bytes = optimizer_state_bytes(*opt) + distinct_storage_bytes(masters.masters);
  }
  return m;
}

// A c10d::Reducer over `model`'s params, set up as torch's DDP sets it up.
std::shared_ptr<c10d::Reducer> make_c10d_reducer(BenchModel& model, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                                 double bucket_mb, double first_bucket_mb, bool view) {
  // Broadcast rank 0's params like torch DDP's init sync (they are already equal: same seed).
  std::vector<at::Tensor> params;
  std::unordered_map<size_t, std::string> names;
  for (auto& item : model.named_parameters()) {
    names[params.size()] = item.key();
    params.push_back(item.value());
  }
  // torch DDP (find_unused_parameters=False): the first iteration uses one bucket (limit SIZE_MAX);
  // rebuild_buckets() before the second forward re-buckets in gradient-ready order with caps
  // [first_bucket_bytes_cap, bucket_bytes_cap]. Bucket lists are passed reversed.
  auto [indices, limits] = c10d::compute_bucket_assignment_by_size(params, {std::numeric_limits<size_t>::max()},
                                                                   std::vector<bool>(params.size(), false));
  std::reverse(indices.begin(), indices.end());
  const int64_t cap = static_cast<int64_t>(bucket_mb * (1 << 20));
  const int64_t first_cap = static_cast<int64_t>(first_bucket_mb * (1 << 20));
  return std::make_shared<c10d::Reducer>(params, indices, group, std::vector<bool>(params.size(), false), cap,
                                         /*find_unused_parameters=*/false, /*gradient_as_bucket_view=*/view, names,
                                         first_cap, /*skip_all_reduce_unused_params=*/false,
                                         /*use_python_reducer=*/false, std::vector<int64_t>{});
}

}  // namespace

// The model (bench/bench_models.h): every candidate builds its own from the same seed.
ModelOptions model_options(const Flags& f) {
  ModelOptions o;
  o.kind = f.model, o.layers = f.layers, o.hidden = f.hidden, o.heads = f.heads, o.seq = f.seq, o.vocab = f.vocab;
  o.batch = f.batch, o.seed = f.seed;
  o.dtype = f.dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  o.device = f.device == "cuda" ? c10::Device(c10::kCUDA) : c10::Device(c10::kCPU);
  return o;
}

std::unique_ptr<Candidate> Bench::make_local(ReadyTimeline* timeline) {
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

std::unique_ptr<Candidate> Bench::make_meshddp(const std::string& name, double bucket_mb, const MeshddpSetup& setup,
                                               ReadyTimeline* timeline) {
  auto model = make_model();
  model->grads_in_buffer = setup.grads_in_buffer;
  auto ddp =
      std::make_shared<meshddp::DistributedDataParallel<BenchModel>>(model, mesh, "dp", ddp_config(setup, bucket_mb));
  std::shared_ptr<torch::optim::Optimizer> opt;
  std::shared_ptr<meshddp::DistributedOptimizer> zopt;
  auto masters = std::make_shared<Fp32Masters>();
  if (setup.zero1) {
    zopt = std::make_shared<meshddp::DistributedOptimizer>(ddp->grad_buffer(), zero1_config(flags.optimizer));
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
    return meshddp_memory(*model, *ddp, opt.get(), zopt.get(), *masters);
  };
  c->extra_json = [ddp, hooks, bucket_mb]() {
    std::ostringstream o;
    o << "\"bucket_mb\": " << bucket_mb << ", \"buckets\": " << ddp->grad_buffer()->layout().buckets.size()
      << ", \"buckets_launched_by_hooks_median\": " << median(*hooks)
      << ", \"layout\": " << layout_json(ddp->grad_buffer())
      << ", \"bytes_per_step_by_group\": " << group_bytes_json(ddp->grad_buffer());
    return o.str();
  };
  return c;
}

std::unique_ptr<Candidate> Bench::make_reducer(bool view, bool bf16) {
  auto model = make_model();
  auto reducer = make_c10d_reducer(*model, group, flags.bucket_mb, flags.reducer_first_bucket_mb, view);
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

std::unique_ptr<Candidate> Bench::make_naive() {
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

}  // namespace bench
