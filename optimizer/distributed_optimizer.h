// DistributedOptimizer: ZeRO-1 over a GradBuffer built with use_distributed_optimizer. Each DP rank
// keeps, for its 1/DP shard of every bucket only, the fp32 master weights (a view of the param
// buffer for fp32 params, a copy for bf16/fp16 ones) and the optimizer state; step() updates those
// shards, writes them into the param buffer and all-gathers every bucket (now, or overlapped with
// the next forward). Checkpoints: optimizer/distributed_optimizer_checkpoint.cpp.
//
// Note [Step order]
//   1. finish_grad_sync() (idempotent): this rank's shard of each bucket holds the DP-mean gradient.
//   2. wait for any param all-gather still pending, then one all-reduce of [non-finite count,
//      sum of squares] over the whole run (each element counted once: DP shards are disjoint): the
//      mesh, or on a pipeline mesh the stage and then the pipeline (grad_buffer/run_stats.h), summed
//      over every model chunk of the rank with step_together().
//   3. non-finite anywhere -> skip: nothing is updated on any rank (of any stage), and the result
//      names the parameters, the DP ranks and the stages that produced them.
//   4. clip: grads *= max_norm / (norm + 1e-6) when that is < 1 (torch's clip_grad_norm_ rule).
//   5. AdamW / SGD on the shards, with the same arithmetic as torch::optim::AdamW / SGD, so a
//      shard's update is bit-identical to the unsharded optimizer's given the same gradient.
//   6. master -> param buffer shard (cast to the param dtype), then the param all-gather.
//   With the fused kernels (config.fused_step; CUDA shards by default): 2 is one statistics pass
//   per shard, and 4-6 one pass per run of same-group params (the clip scale applied on the fly,
//   the grad left unscaled; the master within 2 ulps of the update of the foreach result: Note
//   [Fused step arithmetic] in fused_step_math.h).
#pragma once

#include "../checkpoint/checkpoint_values.h"
#include "../checkpoint/save_options.h"
#include "../grad_buffer/grad_buffer_handle.h"
#include "muon.h"
#include "shard_layout.h"

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

namespace meshddp {

// Declared only: the checkpoint store's pieces (checkpoint/store.h) and a GradBuffer's params
// (grad_buffer/named_param.h), which the parts below pass along.
struct CheckpointTensor;
struct CheckpointMesh;
struct NamedParam;

// kMuon: Muon on the 2-D params (whole matrices, the whole_param shard policy), and on each matrix of
// a 3-D param with muon_stacked_matrices; AdamW on the rest.
enum class OptimizerKind { kAdamW, kSgd, kMuon };

// Which arithmetic step() runs (optimizer/fused_step.h; measurements and the reason: docs/reference/gpu.md).
enum class FusedStep {
  kAuto,    // the fused kernels for CUDA shards, ATen's foreach ops on CPU (faster there today)
  kAlways,  // the fused kernels on CPU too (tests; an error for fp16 params, which they do not write)
  kNever,   // ATen's foreach ops everywhere
};

// Overrides for the parameters whose module path matches `pattern` ('*' matches any run of
// characters, e.g. "*.bias", "*norm*"). The first matching rule wins; a rule that matches no
// trainable parameter is an error (a typo would otherwise silently train with the defaults).
struct ParamGroupRule {
  std::string pattern;
  std::optional<double> lr;
  std::optional<double> weight_decay;
};

struct DistributedOptimizerConfig {
  OptimizerKind kind = OptimizerKind::kAdamW;
  double lr = 1e-3;                         // > 0
  double weight_decay = 0.0;                // AdamW: decoupled (p *= 1 - lr * wd); SGD: L2 added to the gradient
  double beta1 = 0.9;                       // AdamW, in [0, 1)
  double beta2 = 0.999;                     // AdamW, in [0, 1)
  double eps = 1e-8;                        // AdamW, > 0
  double momentum = 0.0;                    // SGD, >= 0 (0 = plain SGD)
  std::vector<ParamGroupRule> groups;       // e.g. {{"*.bias", {}, 0.0}} for no weight decay on biases
  double clip_grad_norm = 0.0;              // > 0: clip the global gradient L2 norm to this; 0 = off
  bool overlap_param_gather = false;        // all-gathers complete during the next forward (DDP::forward)
  FusedStep fused_step = FusedStep::kAuto;  // kAuto: fused on CUDA (one pass per shard), foreach on CPU
  // Muon (kind = kMuon; optimizer/muon.h, docs/reference/optimizer.md). Needs DdpConfig.shard_policy = "whole_param".
  // A param takes Muon when it is 2-D (or 3-D with muon_stacked_matrices) and matches none of
  // muon_adamw_params; the others take AdamW (beta1, beta2, eps above) in the same step. lr /
  // weight_decay / group rules apply to both.
  double muon_momentum = 0.95;                                   // in [0, 1): the EMA factor of the momentum buffer
  bool muon_nesterov = true;                                     // the update is g.lerp(buf, momentum), else buf
  int64_t muon_ns_steps = 5;                                     // Newton-Schulz iterations, in [1, 100)
  NsCoefficients muon_ns_coefficients = NsCoefficients::kTorch;  // "torch" (3.4445,-4.7750,2.0315) | "quintic"
  NsDtype muon_ns_dtype = NsDtype::kBFloat16;                    // the iteration's dtype: "bf16" (as torch) | "fp32"
  MuonScale muon_scale = MuonScale::kOriginal;                   // "original" | "match_rms_adamw" | "spectral"
  double muon_extra_scale = 1.0;                                 // "spectral" only: sqrt(max(m, n)) * this
  double muon_eps = 1e-7;                                        // X / max(||X||_F, eps) before the iteration
  std::string muon_adamw_params = "*embed*,*lm_head*";           // comma-separated patterns: params kept on AdamW
  // A 3-D param [E, m, n] (grouped experts) is a stack of E matrices: owned whole by one DP rank,
  // each slice [i] stepped as its own m x n Muon matrix (momentum, Newton-Schulz, the scale of m x n).
  // false: 3-D params take AdamW. Not for a stack also TP-sharded (refused, naming it).
  bool muon_stacked_matrices = false;

  // Every field is listed once in optimizer/optimizer_config_fields.h (ranges, cross-rank agreement,
  // Python): a new field goes there too, or the build stops.
  void validate() const;  // throws naming the field
};

// The Python package's name for it; one name in both languages.
using OptimizerConfig = DistributedOptimizerConfig;

struct StepResult {
  bool skipped = false;  // true: a non-finite gradient was found; nothing was updated
  double grad_norm = 0;  // global L2 norm of the gradients before clipping (inf/nan when skipped)
  bool clipped = false;  // the gradients were scaled down
  std::string report;    // when skipped: which parameters, which DP ranks
};

// Bytes held per rank, by component.
struct MemoryReport {
  int64_t param_buffer_bytes = 0;     // the flat param buffer (full, not sharded)
  int64_t grad_buffer_bytes = 0;      // the flat grad buffer (full, not sharded)
  int64_t master_weight_bytes = 0;    // fp32 master copies (0 for fp32 params: they update in place)
  int64_t optimizer_state_bytes = 0;  // AdamW moments / SGD momentum, fp32, this rank's shards only
  int64_t grad_scratch_bytes = 0;     // fp32 copies of bf16/fp16 grad shards (no grad_reduce_in_fp32)
  int64_t total() const {
    return param_buffer_bytes + grad_buffer_bytes + master_weight_bytes + optimizer_state_bytes + grad_scratch_bytes;
  }
};

class DistributedOptimizer {
 public:
  // `buffer` (a GradBuffer, or DdpEngine::grad_buffer()) must outlive this optimizer and be built
  // with use_distributed_optimizer.
  DistributedOptimizer(GradBufferHandle buffer, DistributedOptimizerConfig config);

  // One optimizer step (see Note [Step order]). A collective: every rank of the mesh calls it. On a
  // pipeline whose ranks hold several model chunks (virtual stages), step them with step_together():
  // step() on one of them throws, naming it (a chunk's own norm and skip would not be the run's).
  StepResult step();
  // One step of every model chunk this rank holds (one optimizer per chunk, Megatron's chained
  // optimizer): one gradient norm over all of them and every stage, one clipping coefficient, one skip
  // decision; then each chunk's update and param all-gather, in the order given. Every rank passes all
  // its chunks (the same number on every rank; checked in the step's all-reduce, throwing on every rank
  // before anything is updated), each optimizer once, all with the same clip_grad_norm.
  static StepResult step_together(const std::vector<DistributedOptimizer*>& chunks);
  // Waits for the params' all-gathers (before evaluation or anything that reads params outside
  // DistributedDataParallel::forward). On Gloo the host blocks until they are done. On NCCL it is a
  // stream wait (Note [Waiting on NCCL]): it returns at once, and the caller's *current CUDA stream*
  // is ordered after the all-gathers, so kernels later queued on that stream read the new params.
  // Work on another stream, or a host read (a copy to the CPU with non_blocking, a pointer handed to
  // another library or thread), is not ordered by it: make that stream wait on the current one (an
  // event), or synchronize the current stream first. Host reads through ATen (.item(), .cpu()) sync
  // the current stream themselves.
  void finish_param_sync();
  // Refreshes this rank's fp32 master weights from the params (the param buffer), after new values
  // were written into the params outside step(). DistributedDataParallel::load_state_dict() makes
  // step() do this by itself (ParamBuffer::notify_params_changed()); call it after writing params
  // any other way. A no-op for fp32 params, whose masters are the param buffer itself. Only elements
  // whose param differs from the master rounded to the param dtype are reloaded: params not written
  // (a partial load) or written with the value they had keep their fp32 masters. load_checkpoint()
  // leaves the masters current (a load_state_dict before it does not make step() reload them).
  void reload_masters_from_params();

  int64_t steps_taken() const { return step_; }
  MemoryReport memory() const;
  // kMuon: the names of the params Muon updates (2-D, or 3-D with muon_stacked_matrices, matching none
  // of muon_adamw_params), on every DP rank, owned or not; empty for the other kinds.
  std::vector<std::string> muon_params() const;
  const std::vector<BucketShard>& shards() const { return shards_; }
  const DistributedOptimizerConfig& config() const { return config_; }
  // Learning rate of param `index` (after group rules), e.g. for checks.
  double lr_of(int64_t index) const { return groups_[group_of_[index]].lr; }
  // The param group of param `index` (GradBuffer order): 0 the default, then one per ParamGroupRule.
  int64_t group_of(int64_t index) const { return group_of_.at(static_cast<size_t>(index)); }

  // Learning rate and weight decay, e.g. from an LrScheduler (optimizer/lr_scheduler.h); they apply
  // from the next step(). Param groups are 0 (the default) then one per ParamGroupRule, in order.
  // set_lr: every group's LR becomes lr x (its LR / config.lr at construction), so a rule with half
  // the base LR keeps half. set_weight_decay: likewise with config.weight_decay; when that is 0, a
  // rule with its own non-zero weight decay keeps it. Local (no communication): call it with the
  // same value on every rank.
  void set_lr(double lr);
  void set_weight_decay(double weight_decay);
  void set_group_lr(int64_t group, double lr);
  void set_group_weight_decay(int64_t group, double weight_decay);
  int64_t num_groups() const { return static_cast<int64_t>(groups_.size()); }
  double group_lr(int64_t group) const;
  double group_weight_decay(int64_t group) const;
  double lr() const { return lr_; }  // the base LR last set (config.lr until set_lr)

  // Checkpoints (optimizer/distributed_optimizer_checkpoint.cpp; the format: docs/reference/checkpoints.md). save: this
  // optimizer's params and state alone, into <dir>/step-<steps_taken()>/ (crash-safe, all ranks agree); returns that
  // directory. load: `dir`'s latest complete checkpoint (or `step`), at any DP x TP; checks everything on every rank
  // before changing anything; then all-gathers the params; returns the step loaded. Module buffers, frozen params and
  // user values: plugin/training_checkpoint.h. Deprecated for one release: the checkpoint entry point is
  // meshddp::save_checkpoint / load_checkpoint / resume_checkpoint over a TrainingState (its async form:
  // CheckpointSaver), which saves this optimizer with the module; the files are the same format.
  [[deprecated("use meshddp::save_checkpoint(TrainingState{...}, dir, step) (plugin/training_checkpoint.h)")]]
  std::string save_checkpoint(const std::string& dir, const CheckpointSaveOptions& options = {});
  [[deprecated("use meshddp::load_checkpoint(TrainingState{...}, dir) (plugin/training_checkpoint.h)")]]
  int64_t load_checkpoint(const std::string& dir, std::optional<int64_t> step = std::nullopt);
  // The parts, for callers that save more state in the same checkpoint. checkpoint_tensors: this
  // rank's pieces of the params ("model/<name>") and of the state ("optim/master|exp_avg|
  // exp_avg_sq|momentum_buffer/<name>"); for_save leaves out replicated params' pieces on TP ranks
  // other than 0 (they write each element once). checkpoint_info: {"kind", "step"}, checked by
  // check_checkpoint_info before a load. finish_checkpoint_load: after commit_loaded() of
  // checkpoint_tensors(false): masters for params saved without one, the step, the all-gather.
  std::vector<CheckpointTensor> checkpoint_tensors(bool for_save);
  CheckpointOptimizer checkpoint_info() const;
  void check_checkpoint_info(const std::optional<CheckpointOptimizer>& saved, const std::string& where) const;
  void finish_checkpoint_load(const std::vector<CheckpointTensor>& wanted, const std::vector<at::Tensor>& loaded,
                              int64_t step);
  CheckpointMesh checkpoint_mesh() const;

 private:
  struct Group {
    double lr;
    double weight_decay;
    double lr_ratio;  // to the base LR, fixed at construction
    double wd_ratio;  // to the base weight decay; NaN: a fixed value (the base is 0)
  };
  void check_group(int64_t group, const char* who) const;
  struct SegmentViews {  // per group: the tensors the foreach update runs over
    std::vector<at::Tensor> master, grad, state1, state2;
  };

  // step_together's parts: this chunk's [non-finite count, sum of squares] (finishing the gradient
  // and param syncs first; no communication), and steps 4-6 with the clipping coefficient.
  at::Tensor local_stats();
  void apply_step(double grad_scale);
  static void check_chunks(const std::vector<DistributedOptimizer*>& chunks);
  int64_t num_state_tensors() const;  // 2 for AdamW, 1 for SGD with momentum, 0 for plain SGD
  void prepare_grads();               // bf16/fp16 grad shards -> fp32 scratch
  std::string nonfinite_report();     // collective over DP and the pipeline: every rank gets the same text
  void update_adamw();
  void update_sgd();
  void update_muon();
  MuonSettings muon_settings() const;
  void choose_muon_params();  // takes_muon_ (kMuon), with its checks; collective over TP
  void check_muon_tp_pieces(const std::vector<bool>& takes_muon) const;  // collective over TP
  // A param matches a pattern ('*' any run of characters) by its name or any alias.
  static bool name_matches(const std::string& pattern, const NamedParam& p);
  struct MuonMatrix {  // a matrix (or a stack of them) this rank owns whole and updates with Muon
    size_t bucket_shard;
    ShardSegment segment;
    int64_t rows, cols;   // this TP rank's piece (of each matrix of a stack)
    int64_t tp_dim = -1;  // a TP-sharded matrix: the dim its TP pieces are cut along (-1: whole here)
    int64_t stack = 1;    // matrices: E for a 3-D param [E, rows, cols] (muon_stacked_matrices), else 1
  };
  // stats += [non-finite count, sum of squares of what this rank counts (counts_toward_norm in the .cpp)]
  void add_stats_fused(const at::Tensor& stats);
  void update_fused(double grad_scale);  // steps 4-6 (without the gather) in one pass per run
  void write_params_and_gather();
  at::Tensor param_shard(size_t b) const;  // this rank's shard of bucket b's range of the param buffer
  void write_masters_into_param_buffer();  // cast copies of the masters (no-op for fp32 params)

  GradBufferHandle buffer_;
  ParamBuffer* param_buffer_ = nullptr;  // buffer_'s, set once use_distributed_optimizer is checked
  DistributedOptimizerConfig config_;
  std::vector<BucketShard> shards_;
  std::vector<Group> groups_;
  std::vector<int64_t> group_of_;   // per param
  std::vector<at::Tensor> master_;  // per bucket shard, fp32
  std::vector<at::Tensor> grad32_;  // per bucket shard, fp32 view or scratch
  std::vector<at::Tensor> state1_, state2_;
  std::vector<std::vector<int64_t>> state2_offsets_;  // per bucket shard, per segment: its offset in state2_
                                                      // (-1: none, a Muon matrix)
  std::vector<bool> takes_muon_;                      // per param: kMuon updates it with Muon
  std::vector<bool> master_is_param_view_;
  bool fused_ = false;               // config.fused_step resolved for these shards' device and dtypes
  std::vector<SegmentViews> views_;  // per group
  std::vector<MuonMatrix> muon_;     // kMuon: the owned matrices (kept out of views_)
  int64_t step_ = 0;
  int64_t params_version_seen_ = 0;  // ParamBuffer::params_version() the masters were taken at
  double lr_ = 0;
};

}  // namespace meshddp
