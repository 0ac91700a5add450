// The DistributedOptimizer's part of a checkpoint: its params and state as pieces in global
// coordinates (checkpoint/store.h stores them; docs/reference/checkpoints.md has the format).
//
// Note [What a ZeRO-1 rank saves]
// DP rank r owns segment s of param p (elements [s.param_offset, +s.numel) of p's local TP shard)
// for every segment of its shards; it writes exactly those elements of "model/<p>" (the param, in
// its dtype), "optim/master/<p>" (fp32, only for bf16/fp16 params: for fp32 ones the param is the
// master) and the state ("optim/exp_avg/<p>", "optim/exp_avg_sq/<p>" for AdamW,
// "optim/momentum_buffer/<p>" for SGD with momentum and for the Muon matrices of kind muon, whose
// other params have AdamW's two). Replicated params are written by TP rank 0's
// DP group only, and with K optimizer instances (num_distributed_optimizer_instances) each dense shard,
// held by one rank of every instance, by instance 0's rank only: every element is in exactly one
// file. Expert params are sharded over their expert-data-parallel group (GradBuffer::bucket_reduction;
// within the instance, instance 0 writes, as for dense buckets), so each expert's elements too are
// written once, by the ranks of its group; expert
// names are global (DDP checks it), so one key is one expert. A load asks for its own segments at its
// own DP x TP (x EP, and K); the arithmetic in checkpoint/reshard.h finds them in the saved pieces.
#include "checkpoint/store.h"
#include "grad_buffer/grad_buffer.h"
#include "mesh/placement.h"
#include "optimizer/distributed_optimizer.h"
#include "optimizer/optimizer_config_fields.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <set>

namespace meshddp {
namespace {

std::string kind_name(OptimizerKind kind) { return field_text(kind); }

// kMuon: a Muon matrix has one state, stored as "momentum_buffer" (torch.optim.Muon's name); the
// AdamW params have "exp_avg" and "exp_avg_sq".
std::vector<std::string> state_names(OptimizerKind kind, int64_t states) {
  if (kind == OptimizerKind::kAdamW || kind == OptimizerKind::kMuon) return {"exp_avg", "exp_avg_sq"};
  return states > 0 ? std::vector<std::string>{"momentum_buffer"} : std::vector<std::string>{};
}

}  // namespace

CheckpointMesh DistributedOptimizer::checkpoint_mesh() const {
  const SyncGroups& g = buffer_->groups();
  return {g.world ? g.world : g.dp, g.data_parallel_rank(), g.data_parallel_size(), g.tp_rank, g.tp_size};
}

// kMuon also records muon_adamw_params and muon_stacked_matrices: which 2-D and 3-D params took Muon
// decides what state they hold (Muon's momentum_buffer, or AdamW's exp_avg and exp_avg_sq), so a load
// must choose them alike.
CheckpointOptimizer DistributedOptimizer::checkpoint_info() const {
  CheckpointOptimizer info{kind_name(config_.kind), step_, std::nullopt};
  if (config_.kind == OptimizerKind::kMuon) {
    info.muon_adamw_params = config_.muon_adamw_params;
    info.muon_stacked_matrices = config_.muon_stacked_matrices;
  }
  return info;
}

void DistributedOptimizer::check_checkpoint_info(const std::optional<CheckpointOptimizer>& saved,
                                                 const std::string& where) const {
  TORCH_CHECK(
      saved.has_value(), "checkpoint '", where, "' holds no optimizer state (saved without an optimizer); ",
      "load it with plugin/training_checkpoint.h's load_checkpoint and no optimizer, or start the optimizer afresh");
  const std::string& kind = saved->kind;
  TORCH_CHECK(kind == kind_name(config_.kind), "checkpoint '", where, "' holds ", kind, " state but this optimizer is ",
              kind_name(config_.kind),
              " (the state tensors of one kind mean something else to the other); resume with kind = ", kind,
              ", or, to switch optimizers, load the params alone (plugin/training_checkpoint.h's ",
              "load_checkpoint with no optimizer; from Python, ddp.load_state_dict of meshddp-consolidate's output) ",
              "and start this optimizer afresh");
  TORCH_CHECK(config_.kind != OptimizerKind::kMuon || saved->muon_adamw_params.has_value(), "checkpoint '", where,
              "' holds Muon state in the first Muon format (each matrix's momentum buffer under 'optim/exp_avg/', ",
              "without the muon_adamw_params it was saved with), which this version does not read; resume it with ",
              "the version that saved it, or load the params alone and start this optimizer afresh");
  if (config_.kind == OptimizerKind::kMuon) {
    const std::string& saved_patterns = *saved->muon_adamw_params;
    TORCH_CHECK(saved_patterns == config_.muon_adamw_params, "checkpoint '", where,
                "' was saved with muon_adamw_params = '", saved_patterns, "', but this optimizer has '",
                config_.muon_adamw_params, "': a matrix moved between Muon and AdamW would take the other's state ",
                "(Muon's momentum_buffer for AdamW's exp_avg and exp_avg_sq); load with muon_adamw_params = '",
                saved_patterns, "'");
    const auto text = [](bool on) { return std::string(on ? "true" : "false"); };
    TORCH_CHECK(saved->muon_stacked_matrices == config_.muon_stacked_matrices, "checkpoint '", where,
                "' was saved with muon_stacked_matrices = ", text(saved->muon_stacked_matrices),
                ", but this optimizer has muon_stacked_matrices = ", text(config_.muon_stacked_matrices),
                ": its 3-D params would take the other optimizer's state (Muon's momentum_buffer for AdamW's ",
                "exp_avg and exp_avg_sq); load with muon_stacked_matrices = ", text(saved->muon_stacked_matrices));
  }
}

std::vector<CheckpointTensor> DistributedOptimizer::checkpoint_tensors(bool for_save) {
  finish_param_sync();
  const auto& params = buffer_->params();
  const int64_t tp_rank = buffer_->groups().tp_rank;
  const std::vector<std::string> names = state_names(config_.kind, num_state_tensors());
  std::vector<CheckpointTensor> out;
  for (size_t b = 0; b < shards_.size(); ++b) {
    for (size_t si = 0; si < shards_[b].segments.size(); ++si) {
      const ShardSegment& seg = shards_[b].segments[si];
      const NamedParam& p = params[seg.param];
      const Placement& placement = buffer_->placement(seg.param);
      if (for_save && !placement.is_shard() && tp_rank != 0) continue;
      // Hierarchical ZeRO-1: the K instances hold the same shard (dense or expert); instance 0 writes it.
      if (for_save && buffer_->bucket_reduction(shards_[b].bucket).cross_group &&
          buffer_->groups().instance_index() != 0)
        continue;
      const std::vector<int64_t> global = global_shape_of(p.param, placement);
      const TpSlice slice = tp_slice_of(placement);
      auto piece = [&](const std::string& key, const at::Tensor& source, bool optional, int64_t offset) {
        out.push_back({key, source.narrow(0, offset, seg.numel), global, slice, seg.param_offset,
                       seg.param_offset + seg.numel, optional});
      };
      piece("model/" + p.name, param_shard(b), false, seg.shard_offset);
      if (!master_is_param_view_[b]) piece("optim/master/" + p.name, master_[b], /*optional=*/true, seg.shard_offset);
      if (takes_muon_[seg.param]) {
        piece("optim/momentum_buffer/" + p.name, state1_[b], false, seg.shard_offset);
        continue;
      }
      if (names.size() >= 1) piece("optim/" + names[0] + "/" + p.name, state1_[b], false, seg.shard_offset);
      if (names.size() >= 2) piece("optim/" + names[1] + "/" + p.name, state2_[b], false, state2_offsets_[b][si]);
    }
  }
  return out;
}

void DistributedOptimizer::finish_checkpoint_load(const std::vector<CheckpointTensor>& wanted,
                                                  const std::vector<at::Tensor>& loaded, int64_t step) {
  c10::NoGradGuard no_grad;
  std::set<std::string> masters_loaded;
  for (size_t i = 0; i < wanted.size(); ++i) {
    if (loaded[i].defined() && wanted[i].key.rfind("optim/master/", 0) == 0) masters_loaded.insert(wanted[i].key);
  }
  const auto& params = buffer_->params();
  for (size_t b = 0; b < shards_.size(); ++b) {
    if (master_is_param_view_[b]) continue;
    for (const ShardSegment& seg : shards_[b].segments) {
      if (masters_loaded.count("optim/master/" + params[seg.param].name)) continue;
      // Saved without a master (fp32 params, or plain DDP): the param is the master.
      master_[b].narrow(0, seg.shard_offset, seg.numel).copy_(param_shard(b).narrow(0, seg.shard_offset, seg.numel));
    }
  }
  step_ = step;
  write_masters_into_param_buffer();
  param_buffer_->start_param_sync(/*async=*/false);
  // The masters are the checkpoint's: a load_state_dict before this one must not make step() reload
  // them from the (rounded) params.
  params_version_seen_ = param_buffer_->params_version();
}

std::string DistributedOptimizer::save_checkpoint(const std::string& dir, const CheckpointSaveOptions& options) {
  CheckpointMeta meta;
  meta.step = step_;
  meta.optimizer = checkpoint_info();
  return save_checkpoint_files(checkpoint_mesh(), dir, meta, checkpoint_tensors(/*for_save=*/true), options);
}

int64_t DistributedOptimizer::load_checkpoint(const std::string& dir, std::optional<int64_t> step) {
  finish_param_sync();
  std::set<std::string> model_keys;
  for (const NamedParam& p : buffer_->params()) model_keys.insert("model/" + p.name);
  // Each EP rank holds its own experts: a checkpoint key is the model's if any rank has it.
  if (buffer_->groups().expert_dp) model_keys = model_keys_of_every_rank(checkpoint_mesh(), model_keys);
  CheckpointReader reader(checkpoint_mesh(), dir, step);
  std::vector<CheckpointTensor> wanted;
  try {  // a rank that fails here tells the others, which are in read()
    // Not mid-step: the next step would apply the old params' gradients to the loaded ones.
    buffer_->check_no_sync_pending("DistributedOptimizer::load_checkpoint");
    check_checkpoint_info(reader.meta().optimizer, reader.path());
    wanted = checkpoint_tensors(/*for_save=*/false);
  } catch (const std::exception& e) {
    reader.fail(e);
  }
  const std::vector<at::Tensor> loaded = reader.read(wanted, model_keys);
  commit_loaded(wanted, loaded);
  finish_checkpoint_load(wanted, loaded, reader.meta().optimizer->step);
  return reader.meta().step;
}

}  // namespace meshddp
