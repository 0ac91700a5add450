#include "grad_buffer/grad_buffer.h"

#include "grad_buffer/lazy_zeros.h"
#include "grad_buffer/run_stats.h"
#include "grad_buffer/whole_param_layout.h"
#include "mesh/collectives.h"
#include "mesh/pipeline_groups.h"
#include "mesh/switches.h"

#include <ATen/ops/from_blob.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <cmath>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

namespace meshddp {

void GradBufferConfig::validate() const {
  // bucket_bytes is unsigned: every value is meaningful (0 = one bucket per parameter).
  TORCH_CHECK(bucket_bytes <= (size_t{1} << 40), "GradBufferConfig: bucket_bytes = ", bucket_bytes,
              " (over 1 TiB) is surely a unit mistake; give bytes, e.g. 40 << 20 for 40 MiB");
  make_comm_hook(comm_hook);  // throws naming the built-in hooks for an unknown name
  TORCH_CHECK(num_distributed_optimizer_instances >= 1,
              "GradBufferConfig: num_distributed_optimizer_instances = ", num_distributed_optimizer_instances,
              " must be >= 1 (1 = flat ZeRO-1)");
  check_shard_policy(shard_policy);  // "byte_range" | "whole_param"
  const std::string& strategy = data_parallel_sharding_strategy;
  TORCH_CHECK(strategy.empty() || strategy == kNoShard || strategy == kShardOptim || strategy == kShardOptimGrads ||
                  strategy == kShardOptimGradsParams,
              "GradBufferConfig: data_parallel_sharding_strategy = '", strategy, "' is not one of '", kNoShard, "', '",
              kShardOptim, "', '", kShardOptimGrads, "', '", kShardOptimGradsParams,
              "' (or '' to follow use_distributed_optimizer)");
  assign_fsdp_units({}, fsdp_unit_modules);  // throws naming an empty pattern
}

std::string GradBufferConfig::sharding_strategy() const {
  if (!data_parallel_sharding_strategy.empty()) return data_parallel_sharding_strategy;
  return use_distributed_optimizer ? kShardOptim : kNoShard;
}

void GradBufferConfig::apply_sharding_strategy() {
  const std::string strategy = sharding_strategy();
  if (strategy == kShardOptim || strategy == kShardOptimGrads || strategy == kShardOptimGradsParams) {
    use_distributed_optimizer = true;
  }
}

void GradBufferConfig::check_combination() const {
  // Megatron: "optim" is use_distributed_optimizer; a "no_shard" asked for beside it contradicts it.
  TORCH_CHECK(!(data_parallel_sharding_strategy == kNoShard && use_distributed_optimizer),
              "GradBufferConfig: data_parallel_sharding_strategy = '", kNoShard,
              "' but use_distributed_optimizer = true (which is the '", kShardOptim, "' strategy); set one of them: '",
              kShardOptim, "' or '", kShardOptimGrads, "' to shard, or use_distributed_optimizer = false for '",
              kNoShard, "'");
  const bool distributed = use_distributed_optimizer || sharding_strategy() != kNoShard;
  // Megatron-core requires the distributed optimizer too: the instances shard optimizer state, which
  // plain DDP does not have (it all-reduces whole buckets over DP, where instances change nothing).
  TORCH_CHECK(num_distributed_optimizer_instances == 1 || distributed,
              "GradBufferConfig: num_distributed_optimizer_instances = ", num_distributed_optimizer_instances,
              " needs use_distributed_optimizer = true (the instances shard the ZeRO-1 optimizer state; plain DDP ",
              "all-reduces whole buckets and has no state to shard); set use_distributed_optimizer or leave the ",
              "instances at 1");
  TORCH_CHECK(shard_policy == kByteRangeShards || distributed, "GradBufferConfig: shard_policy = '", shard_policy,
              "' needs use_distributed_optimizer = true; set it, or leave shard_policy at 'byte_range'");
}

namespace {

c10::ScalarType main_grad_dtype_of(const at::Tensor& p, bool grad_reduce_in_fp32) {
  const auto dtype = p.scalar_type();
  if (grad_reduce_in_fp32 && (dtype == at::kBFloat16 || dtype == at::kHalf)) return at::kFloat;
  return dtype;
}

}  // namespace

namespace {

// Note [Compiled autograd refused at the hooks]
//   Compiled autograd (torch._dynamo.config.compiled_autograd, or its enable() context around backward)
//   asks every hook of the autograd graph for its compiled_args before running any: torch's default throws
//   "compiled_args nyi ... AccumulationPreHook", which names no way out. It captures the whole backward as
//   one graph, so a bucket could only launch after it; meshddp's hooks refuse it with this message instead
//   (at the first backward under it, whenever it was turned on).
void refuse_compiled_autograd(const std::string& param) {
  TORCH_CHECK(false, "GradBuffer: a backward under compiled autograd (torch._dynamo.config.compiled_autograd or ",
              "torch._dynamo.compiled_autograd.enable) reached the gradient hook of parameter ", param,
              ", which is not supported: compiled autograd captures the whole backward as one graph, leaving no ",
              "point inside it for the bucket reductions (launched by these hooks as gradients arrive) to start. ",
              "Turn compiled autograd off and compile per block (block.compile() for each transformer block, which ",
              "keeps the reductions overlapped with backward) or compile the wrapper (torch.compile(ddp), split ",
              "at the buckets)");
}

}  // namespace

// A pre-hook on a param's AccumulateGrad node; see GradBuffer::before_grad_accumulation().
struct GradBuffer::AccumulationPreHook : torch::autograd::FunctionPreHook {
  AccumulationPreHook(GradBuffer* buffer, int64_t index, std::shared_ptr<std::atomic<bool>> alive)
      : buffer(buffer), index(index), alive(std::move(alive)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (!*alive) return grads;
    return buffer->before_grad_accumulation(index, grads);
  }
  // Note [Compiled autograd refused at the hooks]
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {
    if (!*alive) return;  // a freed buffer's hook passes gradients through: nothing to capture
    refuse_compiled_autograd(describe_param_name(buffer->params_[index]));
  }
  GradBuffer* buffer;
  int64_t index;
  std::shared_ptr<std::atomic<bool>> alive;
};

GradBuffer::GradBuffer(std::vector<NamedParam> params, c10::intrusive_ptr<c10d::ProcessGroup> dp_group,
                       GradBufferConfig config)
    : GradBuffer(std::move(params), SyncGroups{std::move(dp_group), nullptr, 0, 1}, config) {}

GradBuffer::GradBuffer(std::vector<NamedParam> params, SyncGroups groups, GradBufferConfig config)
    : groups_(std::move(groups)),
      config_(config),
      comm_hook_(make_comm_hook(config_.comm_hook)),
      debug_sequence_(switch_on(Switch::kDebugSync)) {
  params_ = split_trainable_params(std::move(params), frozen_params_);
  config_.validate();
  config_.check_combination();
  config_.apply_sharding_strategy();
  shards_grads_ = config_.shards_grads();
  TORCH_CHECK(groups_.dp, "GradBuffer: the data-parallel process group is null");
  dp_size_ = groups_.dp_size();
  const int64_t instances = config_.num_distributed_optimizer_instances;
  TORCH_CHECK(instances == 1 || groups_.cross_instance, "GradBuffer: num_distributed_optimizer_instances = ", instances,
              " but no group across the optimizer instances was given (built from a process group, ",
              "not a DeviceMesh); build DistributedDataParallel from the DeviceMesh so that it makes the instance ",
              "groups, or set num_distributed_optimizer_instances = 1");
  TORCH_CHECK(groups_.instances() == instances, "GradBuffer: num_distributed_optimizer_instances = ", instances,
              " but the group across instances has ", groups_.instances(), " rank(s)");

  std::vector<ParamSpec> specs;
  specs.reserve(params_.size());
  slots_.resize(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const NamedParam& p = params_[i];
    slots_[i].placement = get_placement(p.param);
    const Placement& placement = slots_[i].placement;
    TORCH_CHECK(!placement.is_partial_grad() || (groups_.tp_size > 1 && groups_.world), "GradBuffer: parameter ",
                describe_param_name(p), " has a gradient that is partial over TP (", placement.str(),
                placement.group.empty() ? "" : " over group '" + placement.group + "'",
                ") but this buffer was given no TP dim (TP size ", groups_.tp_size, ") and ",
                groups_.world ? "a" : "no", " world group to sum it over; build DistributedDataParallel from the ",
                "DeviceMesh the model was parallelized over, not from a DP process group");
    if (groups_.tp && !placement.group.empty()) {
      TORCH_CHECK(placement.group == groups_.tp->getGroupName(), "GradBuffer: parameter ", describe_param_name(p),
                  " was parallelized over group '", placement.group, "' (", placement.str(),
                  ") but the gradient sync takes group '", groups_.tp->getGroupName(),
                  "' as its TP dim; wrap the model over the same mesh and dims it was parallelized over");
    }
    const bool expert = is_expert_param(p.param), tied = is_tied_across_stages(p.param);
    if (expert) check_expert_param(p, placement, groups_);
    if (tied) check_tied_param(p, placement, groups_);
    TORCH_CHECK(!tied || !shards_grads_, "GradBuffer: parameter ", describe_param_name(p),
                " is tied across pipeline stages, which data_parallel_sharding_strategy '", config_.sharding_strategy(),
                "' does not support yet (its embedding-group sum needs the whole bucket); use '", kShardOptim, "'");
    specs.push_back(ParamSpec{p.name, p.param.numel(), p.param.scalar_type(),
                              main_grad_dtype_of(p.param, config_.grad_reduce_in_fp32), p.param.device(),
                              placement.is_partial_grad(), expert, tied, p.param.sizes().vec()});
  }
  if (config_.use_distributed_optimizer) config_.pad_for_reduce_scatter = true;
  // "optim_grads_params": buckets never span two FSDP units (Note [Sharded parameters]).
  std::unique_ptr<FsdpUnits> units = config_.shards_params() ? std::make_unique<FsdpUnits>(fsdp_units()) : nullptr;
  for (size_t i = 0; units && i < specs.size(); ++i) specs[i].unit = units->unit_of[i];
  const int64_t expert_dp_size = groups_.expert_dp ? groups_.expert_shard_group()->getSize() : 1;
  const LayoutConfig layout_config{config_.bucket_bytes, config_.pad_for_reduce_scatter, dp_size_, expert_dp_size};
  layout_ = assign_buckets(specs, layout_config);  // then, with whole_param, params re-placed within their buckets:
  if (config_.shard_policy == kWholeParamShards) place_whole_params(layout_, specs, layout_config);

  for (const auto& spec : layout_.buffers) {  // none whole under optim_grads: Note [Sharded gradients]
    buffers_.push_back(
        shards_grads_ ? at::Tensor()
                      : lazy_zeros(spec.numel, at::TensorOptions().dtype(spec.key.grad_dtype).device(spec.key.device)));
  }
  for (size_t i = 0; i < params_.size() && !shards_grads_; ++i) {
    const ParamSlot& slot = layout_.slots[i];
    slots_[i].main_grad = buffers_[slot.buffer].narrow(0, slot.offset, slot.numel).view(params_[i].param.sizes());
  }
  buckets_.resize(layout_.buckets.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    // Chosen once, here: launch, wait, ZeRO-1 shards and the param all-gather use what the bucket holds.
    buckets_[b].reduction = bucket_reduction_of(layout_.buffers[layout_.buckets[b].buffer].key, groups_);
  }
  if (shards_grads_) build_grad_shards();
  if (config_.use_distributed_optimizer) {
    std::vector<ParamGather::Bucket> gather_buckets;
    for (int64_t b = 0; b < static_cast<int64_t>(buckets_.size()); ++b) {
      const BucketReduction& r = buckets_[b].reduction;
      gather_buckets.push_back({{}, {}, "param all-gather of " + bucket_description(b), r.shard_group});
    }
    param_buffer_ = std::make_unique<ParamBuffer>(layout_, params_, std::move(gather_buckets), units.get());
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& param = params_[i].param;
    // Every slot, fp32 main grads of bf16/fp16 params too (for writers that take them: SlotDtypes).
    if (!config_.gradient_accumulation_fusion || shards_grads_) continue;
    // Expanded from one element: a zero of the param's shape that costs nothing to hand out each step.
    slots_[i].grad_placeholder = at::zeros({}, param.options().requires_grad(false)).expand(param.sizes());
    register_grad_slot(param, this, static_cast<int64_t>(i));
  }
  if (counts_nonfinite()) {
    for (int64_t b = 0; b < static_cast<int64_t>(buckets_.size()); ++b) {
      NonfinitePieces pieces = nonfinite_pieces(layout_, b);
      const c10::Device device = layout_.buffers[layout_.buckets[b].buffer].key.device;
      at::Tensor offsets = at::from_blob(pieces.offsets.data(), {pieces.size() + 1}, at::kLong).clone().to(device);
      buckets_[b].nonfinite = BucketNonfinite{std::move(pieces), std::move(offsets), {}, {}};
    }
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    reset_step_state();
  }
  point_grads_at_buffer();
  install_hooks();
}

GradBuffer::~GradBuffer() {
  forget_pipeline_chunks(this);
  *alive_ = false;
  for (const auto& p : params_) unregister_grad_slot(p.param, this);
  remove_hooks();
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<InFlightCollective> in_flight;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const Bucket& bucket = buckets_[b];
    const BucketReduction& r = bucket.reduction;
    const std::string what = bucket_description(static_cast<int64_t>(b));
    if (bucket.tied_work) in_flight.push_back({bucket.tied_work, r.tied_group.get(), "tied sum of " + what});
    if (bucket.work) in_flight.push_back({bucket.work, r.group.get(), "reduction of " + what});
    if (bucket.cross_work) in_flight.push_back({bucket.cross_work, r.cross_group.get(), what + " across instances"});
  }
  // A failed step's reductions may never finish: no waiting forever (Note [Abandoned collectives]).
  wait_or_abandon(in_flight, "a gradient buffer (GradBuffer)");
}

void GradBuffer::install_hooks() {
  for (size_t i = 0; i < params_.size(); ++i) {
    Slot& slot = slots_[i];
    slot.accumulator = torch::autograd::impl::grad_accumulator(params_[i].param);
    TORCH_INTERNAL_ASSERT(slot.accumulator, "no grad accumulator for ", params_[i].name);
    const auto index = static_cast<int64_t>(i);
    slot.post_hook_key = slot.accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, index](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          on_grad_accumulated(index);
          return outputs;
        },
        [this, index](torch::dynamo::autograd::CompiledNodeArgs& /*args*/) {
          refuse_compiled_autograd(
              describe_param_name(params_[index]));  // Note [Compiled autograd refused at the hooks]
        }));
    slot.accumulator->add_pre_hook(std::make_unique<AccumulationPreHook>(this, index, alive_));
  }
}

void GradBuffer::remove_hooks() {
  for (Slot& slot : slots_) {
    if (!slot.accumulator) continue;
    slot.accumulator->del_post_hook(slot.post_hook_key);
    slot.accumulator.reset();
  }
}

void GradBuffer::point_grads_at_buffer() {
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& grad = params_[i].param.mutable_grad();
    if (!shards_grads_ && slots_[i].main_grad.scalar_type() == params_[i].param.scalar_type()) {
      grad = slots_[i].main_grad;  // autograd accumulates in place into the slot: no copy, ever
    } else {
      grad.reset();  // fp32 main grads: the hook adds the low-precision grad in and releases it
    }
  }
}

void GradBuffer::set_is_last_microbatch(bool is_last) {
  std::lock_guard<std::mutex> lock(mutex_);
  is_last_microbatch_ = is_last;
}

bool GradBuffer::is_last_microbatch() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return is_last_microbatch_;
}

void GradBuffer::on_grad_accumulated(int64_t index) {
  // Under create_graph the backward runs in grad mode, and .grad may carry a graph: the slot must
  // not record one (it is a view of the flat buffer that collectives write).
  c10::NoGradGuard no_grad;
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(state_ != StepState::kSynced, "GradBuffer: parameter ", describe_param_name(params_[index]),
              " got a gradient after finish_grad_sync() of this step; call zero_grad_buffer() before the next ",
              "backward (or finish_grad_sync() only after the last micro-batch)");
  Slot& s = slots_[index];
  if (is_last_microbatch_ || shards_grads_) {
    TORCH_CHECK(!s.ready, "GradBuffer: parameter ", describe_param_name(params_[index]),
                " reported ready twice in one step (a second backward before finish_grad_sync(), or, with ",
                "find_unused_parameters, a gradient for a param the forward's outputs did not reach); call ",
                "zero_grad_buffer() between steps, or use no_sync() / set_is_last_microbatch(false) to accumulate ",
                "micro-batches");
  }
  TORCH_CHECK(!buckets_[layout_.slots[index].bucket].launched, "GradBuffer: parameter ",
              describe_param_name(params_[index]), " got a gradient after its bucket was launched this step ",
              "(start_grad_sync() before this backward): the collective already took the bucket's values. Call ",
              "start_grad_sync() after the chunk's last backward micro-batch (weight-gradient passes included)");
  // Move the accumulated gradient into its slot unless it is there already (Note [Slots written in
  // place]: written in place, or added into .grad, the slot, by AccumulateGrad; a stale slot's
  // gradient always arrives as a tensor of its own, since the pre-hook released .grad).
  Bucket& bucket = buckets_[layout_.slots[index].bucket];
  if (shards_grads_ && !bucket.storage.defined()) acquire_bucket_storage(layout_.slots[index].bucket);
  at::Tensor& grad = params_[index].param.mutable_grad();
  const at::Tensor& slot = s.main_grad;
  bool arrived = s.written_in_place || (grad.is_same(slot) && !s.stale);
  if (grad.defined() && !grad.is_same(slot)) {
    if (s.stale) {
      slot.copy_(grad);  // the step's first gradient overwrites the stale slot
    } else if (grad.data_ptr() != slot.data_ptr()) {
      slot.add_(grad);
    }
    arrived = true;
  }
  if (!shards_grads_ && slot.scalar_type() == params_[index].param.scalar_type()) {
    grad = slot;  // .grad was released or replaced (e.g. set to None): point it back at the slot
  } else {
    grad.reset();  // fp32 main grads of a low-precision param, or optim_grads: .grad only carries each new gradient
  }
  if (arrived) {
    s.stale = false;
    s.got_grad = true;
  }
  // "optim_grads_params": the unit's last gradient of this backward releases its params.
  if (ShardedParams* sharded = param_buffer_ ? param_buffer_->sharded() : nullptr) sharded->grad_ready(index);
  // optim_grads: every micro-batch is reduce-scattered (Note [Sharded gradients]).
  if (!is_last_microbatch_ && !shards_grads_) return;

  s.ready = true;
  state_ = StepState::kReducing;
  TORCH_INTERNAL_ASSERT(bucket.pending > 0);
  if (--bucket.pending == 0 && config_.overlap_grad_reduce) launch_ready_buckets_in_order();
  if (shards_grads_ && !is_last_microbatch_) queue_microbatch_flush();
}

int64_t GradBuffer::mark_unreachable_params_ready(const std::vector<at::Tensor>& outputs) {
  // Every node reachable from the outputs' grad_fns (what backward from them can run).
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<const torch::autograd::Node*> stack;
  for (const auto& out : outputs) {
    if (out.defined() && out.requires_grad() && out.grad_fn()) stack.push_back(out.grad_fn().get());
  }
  // No graph (an evaluation forward, e.g. under NoGradGuard): no backward will follow, so this
  // forward is not part of a step and must not mark anything (other ranks may not evaluate).
  if (stack.empty()) return 0;
  while (!stack.empty()) {
    const torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    for (const auto& edge : node->next_edges()) {
      if (edge.function && !seen.count(edge.function.get())) stack.push_back(edge.function.get());
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  // Only on the last micro-batch, "optim_grads" too: marking only launches buckets sooner (its non-last
  // micro-batches' flushes launch every bucket anyway), and a mark in forward would leave the step in
  // flight for the next forward (forward, forward, backward, backward under no_sync()).
  if (!is_last_microbatch_) return 0;
  int64_t marked = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (slots_[i].ready || seen.count(slots_[i].accumulator.get())) continue;
    slots_[i].ready = true;
    state_ = StepState::kReducing;
    ++marked;
    Bucket& bucket = buckets_[layout_.slots[i].bucket];
    TORCH_INTERNAL_ASSERT(bucket.pending > 0);
    --bucket.pending;
  }
  if (marked > 0 && config_.overlap_grad_reduce) launch_ready_buckets_in_order();
  return marked;
}

void GradBuffer::register_comm_hook(std::shared_ptr<CommHook> hook) {
  TORCH_CHECK(hook, "GradBuffer::register_comm_hook: the hook is null");
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(state_ != StepState::kReducing, "GradBuffer::register_comm_hook: this step's gradient sync has begun (",
              next_bucket_, " bucket(s) launched with hook '", comm_hook_->name(), "'); register hook '", hook->name(),
              "' between steps, after finish_grad_sync()");
  comm_hook_ = std::move(hook);
}

SyncStats GradBuffer::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t in_place = 0, accumulated = 0;
  for (const Slot& slot : slots_) {
    in_place += slot.written_in_place ? 1 : 0;
    accumulated += slot.got_grad ? 1 : 0;
  }
  return SyncStats{syncs_completed_, next_bucket_, launched_by_hooks_, in_place, accumulated};
}

int64_t GradBuffer::grad_buffer_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t bytes = shards_grads_ ? storage_pool_.bytes() : 0;
  for (const at::Tensor& buffer : shards_grads_ ? shard_buffers_ : buffers_)
    bytes += static_cast<int64_t>(buffer.nbytes());
  return bytes;
}

const at::Tensor& GradBuffer::main_grad(int64_t index) const {
  TORCH_CHECK(!shards_grads_ || slots_[index].main_grad.defined(), "GradBuffer: parameter ",
              describe_param_name(params_[index]),
              " has no whole main gradient under data_parallel_sharding_strategy '", kShardOptimGrads,
              "': after its bucket's reduce-scatter this rank keeps only its shard of the bucket ",
              "(bucket_shard(b), what DistributedOptimizer steps; gradient norms and clipping come from its step). ",
              "Read the shards, or use '", kShardOptim, "' to keep whole gradients resident");
  return slots_[index].main_grad;
}

c10::ScalarType GradBuffer::main_grad_dtype(int64_t index) const {
  return layout_.buffers[layout_.slots[index].buffer].key.grad_dtype;
}

void GradBuffer::zero_grad_buffer() {
  check_trainable_params_unchanged("zero_grad_buffer()");
  {
    std::lock_guard<std::mutex> lock(mutex_);
    int64_t in_flight = 0;
    for (const auto& b : buckets_) in_flight += (b.work || b.tied_work) ? 1 : 0;
    TORCH_CHECK(in_flight == 0, "GradBuffer: zero_grad_buffer() called while ", in_flight,
                " bucket collective(s) of this step are in flight; call finish_grad_sync() first (zeroing a buffer ",
                "under a running collective corrupts the next step's gradients)");
    zero_slots_for_next_step();
    reset_step_state();
  }
  point_grads_at_buffer();
}

void GradBuffer::reset_step_state() {
  for (Slot& slot : slots_) slot.ready = false;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    bucket.pending = static_cast<int64_t>(layout_.buckets[b].params.size());
    bucket.launched = false;
    bucket.work = {};
    bucket.cross_work = {};
    bucket.tied_work = {};
    bucket.finish = {};
    bucket.nonfinite.piece_counts = bucket.nonfinite.total = bucket.carried_counts = at::Tensor();
    if (bucket.storage_block.defined()) {  // optim_grads: a step abandoned before its sync
      for (int64_t i : layout_.buckets[b].params) slots_[i].main_grad = at::Tensor();
      storage_pool_.release(layout_.buckets[b].buffer, std::move(bucket.storage_block));
      bucket.storage_block = bucket.storage = at::Tensor();
    }
  }
  next_bucket_ = 0;
  next_to_complete_ = 0;
  flush_queued_ = false;
  microbatches_reduced_ = 0;
  launched_by_hooks_ = 0;
  state_ = StepState::kIdle;
}

void GradBuffer::check_no_sync_pending(const char* who) const {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(state_ != StepState::kReducing, who, ": a new step began before finish_grad_sync() of the previous ",
              "one (its gradient sync has started). Parameters that have not reported a gradient yet: ",
              unready_param_names(8), ". Call finish_grad_sync() after the last backward of every step (it also ",
              "covers parameters that got no gradient), then zero_grad_buffer()");
}

at::Tensor GradBuffer::bucket_data(int64_t b) const {
  if (shards_grads_) {
    TORCH_INTERNAL_ASSERT(buckets_[b].storage.defined(), "bucket ", b, " has no storage (optim_grads)");
    return buckets_[b].storage;
  }
  const BucketSpan& span = layout_.buckets[b];
  return buffers_[span.buffer].narrow(0, span.begin, span.numel());
}

at::Tensor GradBuffer::bucket_shard(int64_t b) const {
  if (shards_grads_) return grad_shards_[b];
  return reduced_shard(b);
}

at::Tensor GradBuffer::reduced_shard(int64_t b) const {
  const int64_t n = layout_.buckets[b].numel();
  const BucketReduction& r = buckets_[b].reduction;
  TORCH_INTERNAL_ASSERT(n % r.shard_size == 0, "bucket ", b, " is not padded to a multiple of its group's size");
  return bucket_data(b).narrow(0, r.shard_rank * (n / r.shard_size), n / r.shard_size);
}

bool GradBuffer::is_expert(int64_t index) const { return layout_.buffers[layout_.slots[index].buffer].key.expert; }

at::Tensor GradBuffer::local_nonfinite_counts() const {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(config_.use_distributed_optimizer,
              "GradBuffer: non-finite counts are kept with use_distributed_optimizer");
  if (buckets_.empty()) return at::zeros({0}, at::TensorOptions().dtype(at::kLong));  // no trainable params
  std::vector<at::Tensor> totals;
  for (const Bucket& bucket : buckets_) {
    const BucketNonfinite& nonfinite = bucket.nonfinite;
    totals.push_back(nonfinite.total.defined() ? nonfinite.total : at::zeros({}, nonfinite.offsets.options()));
  }
  return at::stack(totals);
}

std::vector<int64_t> GradBuffer::local_nonfinite_counts_by_param() const {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(config_.use_distributed_optimizer || config_.check_for_nan_in_grad,
              "GradBuffer: non-finite counts are kept with use_distributed_optimizer or check_for_nan_in_grad");
  return nonfinite_by_param();
}

std::string GradBuffer::bucket_description(int64_t b) const {
  const BucketSpan& span = layout_.buckets[b];
  const BufferKey& key = layout_.buffers[span.buffer].key;
  std::ostringstream out;
  out << "gradient bucket " << b << " of " << layout_.buckets.size() << " (" << span.params.size() << " params from "
      << describe_param_name(params_[span.params.front()]) << ", " << span.numel() << " " << key.grad_dtype
      << " elements on " << key.device << (key.expert ? ", expert params: over the expert-data-parallel group" : "")
      << ")";
  return out.str();
}

void GradBuffer::check_trainable_params_unchanged(const char* who) const {
  for (size_t i = 0; i < params_.size(); ++i) {
    // Converted or moved after wrapping (model.double(), model.to(...), p.data = ...): its slots are fixed.
    const NamedParam& p = params_[i];
    const ParamSlot& slot = layout_.slots[i];
    const BufferKey& key = layout_.buffers[slot.buffer].key;
    TORCH_CHECK(p.param.scalar_type() == key.param_dtype && p.param.device() == key.device, "GradBuffer::", who,
                ": parameter ", describe_param_name(p), " is now ", p.param.scalar_type(), " on ", p.param.device(),
                " but was ", key.param_dtype, " on ", key.device,
                " when the model was wrapped (converted or moved after ",
                "wrapping: model.double(), model.to(...), param.data = ...). Its gradient slot is fixed when ",
                "DistributedDataParallel is built: convert and move the model before wrapping (re-wrap it, with a new ",
                "optimizer, to change it)");
    if (param_buffer_) param_buffer_->check_param_in_place(p, slot, who);
  }
  for (const NamedParam& p : params_) {
    TORCH_CHECK(p.param.requires_grad(), "GradBuffer::", who, ": parameter ", describe_param_name(p),
                " was trainable when the model was wrapped but now has requires_grad=False (frozen after wrapping). ",
                "Its slot in the gradient buffer would still take part in every step with a zero gradient, which an ",
                "optimizer with weight decay or momentum still applies to it. Which params train is fixed when ",
                "DistributedDataParallel is built: set requires_grad before wrapping (re-wrap the model, with a new ",
                "optimizer, to change it)");
  }
  for (const NamedParam& p : frozen_params_) {
    TORCH_CHECK(
        !p.param.requires_grad(), "GradBuffer::", who, ": parameter ", describe_param_name(p),
        " was frozen (requires_grad=False) when the model was wrapped but now requires grad (unfrozen after ",
        "wrapping). It has no slot in the gradient buffer, so its gradient would not be averaged across ranks. ",
        "Which params train is fixed when DistributedDataParallel is built: set requires_grad before wrapping ",
        "(re-wrap the model, with a new optimizer, to change it)");
  }
}

std::string GradBuffer::unready_param_names(size_t limit) const {
  std::ostringstream out;
  size_t count = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (slots_[i].ready) continue;
    if (count < limit) out << (count ? ", " : "") << describe_param_name(params_[i]);
    ++count;
  }
  if (count > limit) out << " and " << (count - limit) << " more";
  if (count == 0) out << "(none)";
  return out.str();
}

}  // namespace meshddp
