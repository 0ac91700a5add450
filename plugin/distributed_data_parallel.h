// DistributedDataParallel: wraps a LibTorch module for data parallelism over one dim of a
// DeviceMesh (or a DP process group). Construction checks that every DP rank holds the same
// parameters and broadcasts DP rank 0's parameters and buffers; forward passes through; the
// gradients live in a GradBuffer whose buckets are reduced during backward.
//
// A step:
//   ddp.zero_grad_buffer();
//   for (micro-batch m of k) {
//     ddp.set_is_last_microbatch(m == k - 1);   // or: wrap micro-batches 0..k-2 in ddp.no_sync()
//     auto loss = loss_fn(ddp.forward(x_m), y_m) / k;
//     loss.backward();
//   }
//   ddp.finish_grad_sync();    // param.grad() (or main_grad) now holds the DP mean
//   optimizer.step();
#pragma once

#include "../grad_buffer/grad_buffer_config.h"
#include "../grad_buffer/grad_buffer_handle.h"
#include "../grad_buffer/named_param.h"
#include "../grad_buffer/sync_groups.h"
#include "../mesh/device_mesh.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/nn/module.h>
#include <torch/ordered_dict.h>

#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace meshddp {

// The engine's internals (grad_buffer/grad_buffer.h, param_gather.h, comm_hook.h): declared here
// only, so that this public header does not reach them.
class GradBuffer;
class ParamGather;
class ShardedParams;
class CommHook;
class ParamClaim;  // plugin/module_ownership.h

struct DdpConfig : GradBufferConfig {
  // GradBufferConfig: bucket_bytes (40 MiB; 0 = one bucket per parameter), overlap_grad_reduce (true),
  // grad_reduce_in_fp32 (false), pad_for_reduce_scatter (false), find_unused_parameters (false),
  // use_distributed_optimizer (false: set it to pair with DistributedOptimizer, which then owns the
  // param update and all-gather).
  bool broadcast_from_rank0 = true;         // at construction, every DP rank takes DP rank 0's params and buffers,
                                            // then every TP rank takes TP rank 0's replicated (non-sharded) ones
  bool verify_model_across_ranks = true;    // at construction, check every DP rank has the same parameters
  bool broadcast_buffers = true;            // before each step's first training forward (grad mode on; the first
                                            // after construction or zero_grad_buffer()), every DP rank takes DP rank
                                            // 0's module buffers, written only where they differ (Note [Module
                                            // buffers once per step]). Nothing is done when the model has none
  int64_t tp_replica_check_interval = 100;  // with TP > 1: at the first forward of step 1 and of every N-th
                                            // step after (1, 1+N, ...), compare a bit-exact checksum of each
                                            // TP-replicated param across the TP group and name the first one
                                            // that drifted (e.g. an undeclared sequence-parallel norm).
                                            // Costs one read of the replicated params and one small
                                            // all-gather per check. 0 = off
  int64_t expert_parallel_size = 1;         // (Megatron's name) EP, carved out of the DP (x CP) ranks: each block of
                                            // this many consecutive DP ranks holds different experts
                                            // (mesh/reduction_groups.h). Expert params (declare_expert_param, or the
                                            // plan style ExpertParallel) are reduced over the expert-data-parallel
                                            // group (DP size / EP ranks holding the same experts), dense ones over DP.
                                            // >= 1, must divide the DP (x CP) size; > 1 needs a DeviceMesh. 1 = the
                                            // expert-DP group is the DP group
  // Pipeline parallel (docs/guide/pipelines.md): V, the model chunks each rank holds (Megatron's
  // virtual_pipeline_model_parallel_size), and which of them this DDP wraps (0..V-1). On a mesh with
  // a "pp" dim, every rank's pp size and V are compared at the construction of its chunk 0, and a
  // weight tied across stages is exchanged by the first stage's chunk 0 and the last stage's chunk V-1
  int64_t virtual_pipeline_size = 1;
  int64_t virtual_pipeline_chunk = 0;

  void validate() const;  // throws naming the field
  // Every field (GradBufferConfig's too) is listed once in plugin/ddp_config_fields.h, which drives
  // validation, the cross-rank agreement and Python: a new field goes there too, or the build stops.
};

// The module-type-independent part. Use DistributedDataParallel<ModuleT>.
class DdpEngine {
 public:
  DdpEngine(std::shared_ptr<torch::nn::Module> module, const DeviceMesh& mesh, const std::string& dp_dim,
            DdpConfig config);
  // Over several dims (e.g. {"dp", "cp"}, in mesh order): every gradient is averaged over their
  // flattened group (mesh.flattened(dp_dims), 1/(dp*cp)); the one remaining dim with more than one
  // rank is TP. Collective over the whole mesh (the flattened group may be made here). With expert
  // params, expert gradients are averaged over the expert-data-parallel group instead
  // (expert_data_parallel_groups(sizes, names, dp_dims, config.expert_parallel_size), made here as
  // mesh.group_of("expert_dp.dp+cp.ep2", ...); the DP group itself at EP 1); expert params are
  // checked and broadcast within it.
  DdpEngine(std::shared_ptr<torch::nn::Module> module, const DeviceMesh& mesh, const std::vector<std::string>& dp_dims,
            DdpConfig config);
  // Over a DP group alone: expert params only with expert_parallel_size 1 (reduced over DP).
  DdpEngine(std::shared_ptr<torch::nn::Module> module, c10::intrusive_ptr<c10d::ProcessGroup> dp_group,
            DdpConfig config);
  // For callers that hold no torch::nn::Module (the Python package, plugin/python/): the module's
  // parameters (registration order; a tensor under two names is one param) and its buffers, the
  // groups, and DP rank -> global rank for messages (may be empty). Same checks and broadcasts as
  // above; the settings are agreed over groups.world (or the DP group when it is null). With
  // hierarchical ZeRO-1 (groups.cross_instance set), groups.dp is this rank's optimizer instance and
  // `data_parallel_group` the whole DP (x CP) group (the model checks and broadcasts run over it, as
  // with the mesh constructor); null: groups.dp.
  DdpEngine(std::vector<NamedTensor> params, std::vector<NamedTensor> buffers, SyncGroups groups,
            const std::vector<int64_t>& dp_global_ranks, DdpConfig config,
            c10::intrusive_ptr<c10d::ProcessGroup> data_parallel_group = {});
  // Virtual: a pipeline holds its chunks, of different module types, as std::unique_ptr<DdpEngine>,
  // and deleting one must destroy the DistributedDataParallel<M> around it (its module) too.
  // Under "optim_grads_params" it is collective: it gathers every unit and leaves the module's params
  // whole (plain tensors), so every rank destroys its wrapper at the same point, as SPMD code does;
  // not while an exception unwinds it, nor for the Python wrapper (Note [A module outliving its ZeRO-3
  // wrapper], plugin/ddp_engine_controls.cpp).
  virtual ~DdpEngine();
  DdpEngine(DdpEngine&&) noexcept;
  DdpEngine& operator=(DdpEngine&&) noexcept;

  // Blocks until every bucket is reduced (launching those not launched yet, in order). A second call
  // in the same step is a no-op.
  void finish_grad_sync();

  // -- The controls a pipeline schedule drives (docs/guide/pipelines.md; plugin/pipeline.h) --
  // Launches now, in bucket order, every bucket not launched yet (a param that got no gradient
  // contributes its slot), without waiting: after a chunk's last backward micro-batch, so that its
  // sync overlaps the other chunks' backward. finish_grad_sync() then waits.
  void start_grad_sync();
  // FSDP2's name. false: hold every bucket (backward only accumulates) until it is set true again;
  // the same switch as set_is_last_microbatch() and no_sync(). Default true.
  void set_requires_gradient_sync(bool requires_sync);
  bool requires_gradient_sync() const;
  // Multiplies the flat gradient buffers by `factor` (never param.grad(), which with fp32 main grads
  // or ZeRO-1 is not what the optimizer reads). Between micro-batches, or after finish_grad_sync()
  // and before the optimizer step; throws while a bucket collective is in flight.
  void scale_gradients(double factor);
  // Every param takes DP rank 0's values, over its reduction group (dense params over DP (x CP),
  // expert params over expert-DP), then a param tied across stages the first stage's copy (over the
  // embedding group). Collective; call between steps on every rank of those groups. Keeps the
  // distributed optimizer's master weights in step.
  void broadcast_params();
  // Throws on every rank of the embedding group, naming the param and each side's bit checksum, when
  // the two copies of a weight tied across stages differ. Collective over the embedding group: call
  // it on the chunk that holds the tied param (first stage: chunk 0; last stage: chunk V-1) of both
  // stages. A no-op on chunks without tied params. plugin/pipeline.cpp.
  void check_tied_params_identical() const;
  // Whether this step's sync finished / began (GradBuffer::grad_sync_finished / _started).
  bool grad_sync_finished() const;
  // Zeroes the gradient buffers for the next step (and points param.grad() back at them). The step's
  // first training forward then broadcasts the module buffers (broadcast_buffers).
  void zero_grad_buffer();
  // Whether the next training forward broadcasts the module buffers (broadcast_buffers): true after
  // construction and zero_grad_buffer(), false after that broadcast. meshddp.pipelining sets it back
  // after the zeroing it does between the schedule steps of one optimizer step.
  bool buffers_broadcast_due() const { return buffers_broadcast_due_; }
  void set_buffers_broadcast_due(bool due) { buffers_broadcast_due_ = due; }
  // The module's parameters, one entry per tensor (a tensor registered under two names, tied
  // weights, is listed once under its first name): give these to the optimizer. Frozen ones included.
  std::vector<at::Tensor> parameters() const;
  const std::vector<NamedParam>& named_parameters() const { return unique_params_; }
  // Copies `state` (parameter and buffer values by module path, e.g. another model's
  // named_parameters() and named_buffers(), or this rank's shards of a TP model) into the wrapped
  // module. Strict: every param and buffer must be given, with its shape; unknown names are an
  // error; nothing changes unless all check out. Aliases of tied params are accepted. Keeps the
  // distributed optimizer's fp32 master weights in step (it reloads them before its next step).
  // Call between steps (not while a gradient sync is pending). Every rank loads its own values.
  void load_state_dict(const torch::OrderedDict<std::string, at::Tensor>& state);
  // false for micro-batches before the last: backward only accumulates, no sync. Default true.
  void set_is_last_microbatch(bool is_last);
  // PyTorch DDP's register_comm_hook: replaces how each bucket is reduced (GradBuffer::register_comm_hook).
  void register_comm_hook(std::shared_ptr<CommHook> hook);

  // RAII scope in which backward only accumulates (PyTorch's no_sync()).
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(GradBuffer& buffer);
    ~NoSyncGuard();
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    GradBuffer& buffer_;
    bool previous_;
  };
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*buffer_); }

  // Every param whole, to read (an evaluation outside a forward through the wrapper, logging, an
  // export): FSDP's summon_full_params. Under "optim_grads_params" it is collective: every rank of the
  // mesh calls it at the same point, between steps. Each FSDP unit is all-gathered at once and stays
  // whole until the scope ends (forwards and backwards inside it keep it; a step inside it gathers
  // the new values), when every unit is released again. Read-only: an in-place write to a param is
  // refused as outside it (change params through the DistributedOptimizer or a checkpoint load).
  // Under the other strategies the params are whole already: with the distributed optimizer it waits
  // for the param all-gather in flight (as DistributedOptimizer::finish_param_sync()), else nothing.
  // Scopes nest. The wrapper must outlive the scope.
  class FullParamsScope {
   public:
    explicit FullParamsScope(ShardedParams* sharded);
    ~FullParamsScope();
    FullParamsScope(const FullParamsScope&) = delete;
    FullParamsScope& operator=(const FullParamsScope&) = delete;

   private:
    ShardedParams* sharded_ = nullptr;
    std::weak_ptr<const void> alive_;  // expired: the wrapper was destroyed inside the scope (its params left whole)
  };
  [[nodiscard]] FullParamsScope gather_full_params();

  // The synced gradient of a trainable parameter by module path (fp32 with grad_reduce_in_fp32).
  at::Tensor main_grad(const std::string& name) const;
  // The gradient buffer, as its users see it (the optimizer, checkpoints, Python, benchmarks):
  // read-only but for finish_grad_sync(), and its ZeRO-1 param buffer.
  GradBufferHandle grad_buffer() const { return GradBufferHandle(*buffer_); }
  // The param all-gather of the distributed optimizer (null without use_distributed_optimizer).
  ParamGather* param_gather() const;
  c10d::ProcessGroup& dp_group() const { return *dp_group_; }
  const DdpConfig& config() const { return config_; }

 protected:
  // Called by forward before running the module. A forward with grad mode off (evaluation) touches
  // no sync state and runs no collective, so it may run on some ranks only, at any time. A training
  // forward checks the previous step's sync finished, runs the TP-replica check when due, and, at the
  // step's first training forward, broadcasts the module buffers (broadcast_buffers: dense ones over DP,
  // expert ones over expert-DP; Note [Module buffers once per step]).
  void before_forward();
  // With find_unused_parameters: marks the params the outputs cannot reach as ready (gradient 0).
  void after_forward(const at::Tensor& output) const;
  void after_forward(const std::vector<at::Tensor>& outputs) const;
  template <typename T>
  void after_forward(const T&) const {
    TORCH_CHECK(!config_.find_unused_parameters || !c10::GradMode::is_enabled(),
                "DistributedDataParallel: find_unused_parameters needs forward to ",
                "return a Tensor or a std::vector<Tensor> to walk the autograd graph from");
  }
  // Open for the duration of forward: ops wait for pending param all-gathers of their own params
  // (ParamGather::ForwardScope; nothing to open without the distributed optimizer), or under
  // "optim_grads_params" gather their unit on use and release it after (ShardedParams::UseScope).
  class ParamWaitScope {
   public:
    ParamWaitScope(ParamGather* gather, ShardedParams* sharded);
    ~ParamWaitScope();
    ParamWaitScope(const ParamWaitScope&) = delete;
    ParamWaitScope& operator=(const ParamWaitScope&) = delete;

   private:
    struct Open;  // the ForwardScope, defined where ParamGather is
    std::unique_ptr<Open> open_;
  };
  ParamWaitScope param_wait_scope() const { return ParamWaitScope(param_gather(), sharded_params()); }
  // "optim_grads_params": the sharded params (Note [Sharded parameters]); null under the other strategies.
  ShardedParams* sharded_params() const;
  // The whole GradBuffer, for subclasses that feed it gradients of their own (plugin/python/).
  GradBuffer& buffer() { return *buffer_; }
  // "optim_grads_params": whether the destructor gathers the params whole (a collective). Off for a
  // wrapper destroyed when a garbage collector decides (Python), which ranks do not do alike.
  bool leave_params_whole_at_destruction_ = true;

 private:
  // The expert-data-parallel group and its global ranks (for messages); made by init() only when
  // the model has expert params, after the ranks agreed on that.
  struct ExpertGroup {
    c10::intrusive_ptr<c10d::ProcessGroup> group;
    std::vector<int64_t> global_ranks;
  };
  using ExpertGroupMaker = std::function<ExpertGroup()>;
  void init(const std::shared_ptr<torch::nn::Module>& module, const std::vector<int64_t>& dp_global_ranks,
            c10d::ProcessGroup& agreement_group, const ExpertGroupMaker& expert_group);
  void init(std::vector<NamedTensor> params, std::vector<NamedTensor> buffers,
            const std::vector<int64_t>& dp_global_ranks, c10d::ProcessGroup& agreement_group,
            const ExpertGroupMaker& expert_group);
  // init()'s phases, in order: the ranks agree on the settings (then they are validated); the
  // reduction groups are made and params and buffers sorted into them (dense, expert); the model is
  // compared across ranks; DP (expert-DP, TP) rank 0's params and buffers are broadcast; the
  // GradBuffer lays out the buckets; the ranks' layouts are compared.
  struct InitState;
  void agree_on_settings(InitState& s);
  void make_reduction_groups(InitState& s, const ExpertGroupMaker& expert_group);
  void verify_same_model(InitState& s);
  void broadcast_initial_state(const InitState& s);
  void lay_out_gradient_buffer(const InitState& s);
  void check_layouts_agree(const InitState& s);
  // The expert-DP group over a DP group alone: the DP group itself when expert_parallel_size is 1.
  ExpertGroup expert_group_without_mesh(const std::vector<int64_t>& dp_global_ranks) const;
  void maybe_check_tp_replicas();
  // plugin/pipeline.cpp. On a mesh with a pp dim, at chunk 0: every rank's pp size and V agree (over
  // the whole mesh). Then, on the chunk that holds the tied params: the two stages' tied layouts agree
  // and the first stage's values are broadcast (over the embedding group).
  static void verify_pipeline_settings(const DeviceMesh& mesh, const DdpConfig& config);
  void sync_tied_params_at_construction();
  std::vector<NamedTensor> tied_params() const;

  c10::intrusive_ptr<c10d::ProcessGroup> dp_group_;
  SyncGroups groups_;
  DdpConfig config_;
  std::unique_ptr<GradBuffer> buffer_;
  std::vector<NamedParam> unique_params_;    // every param once (aliases listed), frozen ones too
  std::vector<NamedTensor> module_buffers_;  // dense buffers: broadcast over DP
  // Buffers inside experts: over expert-DP (Note [Buffers follow the module that owns them]).
  std::vector<NamedTensor> expert_buffers_;
  std::unique_ptr<ParamClaim> claim_;      // this engine's params, refused to a second live engine
  std::vector<NamedParam> tp_replicated_;  // trainable params every TP rank holds whole (not sharded)
  int64_t last_replica_check_ = -1;        // syncs_completed() at the last TP-replica check
  bool buffers_broadcast_due_ = true;      // the next training forward broadcasts the module buffers
};

template <typename ModuleT>
class DistributedDataParallel : public DdpEngine {
 public:
  DistributedDataParallel(std::shared_ptr<ModuleT> module, const DeviceMesh& mesh, const std::string& dp_dim = "dp",
                          DdpConfig config = {})
      : DdpEngine(module, mesh, dp_dim, config), module_(std::move(module)) {}
  // Context parallel: DistributedDataParallel(model, mesh, {"dp", "cp"}, config) averages every
  // gradient over the flattened DP x CP group (DdpEngine's constructor above).
  DistributedDataParallel(std::shared_ptr<ModuleT> module, const DeviceMesh& mesh, std::vector<std::string> dp_dims,
                          DdpConfig config = {})
      : DdpEngine(module, mesh, dp_dims, config), module_(std::move(module)) {}
  // So that a braced list ({"dp", "cp"}) picks the constructor above rather than std::string's
  // iterator-pair constructor (the call would otherwise be ambiguous).
  DistributedDataParallel(std::shared_ptr<ModuleT> module, const DeviceMesh& mesh,
                          std::initializer_list<std::string> dp_dims, DdpConfig config = {})
      : DistributedDataParallel(std::move(module), mesh, std::vector<std::string>(dp_dims), config) {}
  DistributedDataParallel(std::shared_ptr<ModuleT> module, c10::intrusive_ptr<c10d::ProcessGroup> dp_group,
                          DdpConfig config = {})
      : DdpEngine(module, std::move(dp_group), config), module_(std::move(module)) {}

  // The wrapped module's forward, after checking the previous step's sync has finished.
  template <typename... Args>
  auto forward(Args&&... args) {
    before_forward();
    auto scope = param_wait_scope();
    auto output = module_->forward(std::forward<Args>(args)...);
    after_forward(output);
    return output;
  }
  ModuleT& module() { return *module_; }
  const std::shared_ptr<ModuleT>& module_ptr() const { return module_; }

 private:
  std::shared_ptr<ModuleT> module_;
};

}  // namespace meshddp
