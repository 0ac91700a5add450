#include "plugin/training_checkpoint.h"

#include "mesh/placement.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <set>

namespace meshddp {
namespace {

struct Parts {
  CheckpointMesh mesh;
  int64_t dp_rank = 0, dp_size = 1, tp_rank = 0;
  int64_t expert_dp_rank = 0, expert_dp_size = 1;  // expert params are held by their expert-DP group only
  bool has_experts = false;
};

Parts parts_of(const TrainingState& state) {
  TORCH_CHECK(state.module && state.ddp, "checkpoint: TrainingState needs module and ddp");
  TORCH_CHECK(
      !(state.distributed_optimizer && state.optimizer),
      "checkpoint: TrainingState has both a DistributedOptimizer and a torch optimizer; give the one that steps");
  const SyncGroups& g = state.ddp->grad_buffer()->groups();
  Parts p;
  // Over the whole DP group (with K optimizer instances, `g.dp` is one instance of D/K ranks).
  p.mesh = {g.world ? g.world : g.dp, g.data_parallel_rank(), g.data_parallel_size(), g.tp_rank, g.tp_size};
  p.dp_rank = g.data_parallel_rank();
  p.dp_size = g.data_parallel_size();
  p.tp_rank = g.tp_rank;
  if (g.expert_dp) {
    p.has_experts = true;
    p.expert_dp_rank = g.expert_dp->getRank();
    p.expert_dp_size = g.expert_dp->getSize();
  }
  return p;
}

// One module tensor (param or buffer) as a piece: for a save, this DP rank's even share of the
// local tensor (TP rank 0 only for tensors not sharded over TP; for an expert param or buffer, this
// expert-DP rank's share: only its expert-DP group holds it); for a load, all of it.
void add_module_tensor(std::vector<CheckpointTensor>& out, const std::string& key, const at::Tensor& tensor,
                       const Placement& placement, bool is_expert, const Parts& parts, bool for_save) {
  if (for_save && !placement.is_shard() && parts.tp_rank != 0) return;
  at::Tensor flat = tensor.detach();
  TORCH_CHECK(flat.is_contiguous(), "checkpoint: '", key, "' is not contiguous");
  flat = flat.view({-1});
  int64_t begin = 0, end = flat.numel();
  if (for_save && is_expert) {
    std::tie(begin, end) = even_split(flat.numel(), parts.expert_dp_rank, parts.expert_dp_size);
  } else if (for_save) {
    std::tie(begin, end) = even_split(flat.numel(), parts.dp_rank, parts.dp_size);
  }
  out.push_back({key, flat.narrow(0, begin, end - begin), global_shape_of(tensor, placement), tp_slice_of(placement),
                 begin, end, false});
}

// The module's tensors this checkpoint covers: every param (but trainable ones under ZeRO-1: the
// DistributedOptimizer saves those from its shards) and every buffer.
std::vector<CheckpointTensor> module_tensors(const TrainingState& state, const Parts& parts, bool for_save,
                                             std::set<std::string>& model_keys) {
  std::vector<CheckpointTensor> out;
  for (const auto& item : state.module->named_parameters(/*recurse=*/true)) {
    model_keys.insert("model/" + item.key());
    if (state.distributed_optimizer && item.value().requires_grad()) continue;
    add_module_tensor(out, "model/" + item.key(), item.value(), get_placement(item.value()),
                      is_expert_param(item.value()), parts, for_save);
  }
  for (const auto& item : state.module->named_buffers(/*recurse=*/true)) {
    model_keys.insert("model/" + item.key());
    // Buffers inside experts were declared expert tensors by DDP (Note [Buffers follow the module that owns them]).
    add_module_tensor(out, "model/" + item.key(), item.value(), get_placement(item.value()),
                      is_expert_param(item.value()), parts, for_save);
  }
  return out;
}

// A torch optimizer's per-param state: AdamW (exp_avg, exp_avg_sq, step) or SGD (momentum_buffer).
struct TorchOptimizerState {
  std::string kind;
  std::vector<std::string> names;
};

TorchOptimizerState torch_kind(torch::optim::Optimizer& opt) {
  if (dynamic_cast<torch::optim::AdamW*>(&opt)) return {"adamw", {"exp_avg", "exp_avg_sq"}};
  if (dynamic_cast<torch::optim::SGD*>(&opt)) return {"sgd", {"momentum_buffer"}};
  TORCH_CHECK(false, "checkpoint: only torch::optim::AdamW and SGD (or meshddp's DistributedOptimizer) can be saved");
}

at::Tensor torch_state_tensor(const torch::optim::OptimizerParamState& s, const std::string& name) {
  if (const auto* a = dynamic_cast<const torch::optim::AdamWParamState*>(&s)) {
    TORCH_CHECK(!a->max_exp_avg_sq().defined(), "checkpoint: AdamW with amsgrad is not supported");
    return name == "exp_avg" ? a->exp_avg() : a->exp_avg_sq();
  }
  return static_cast<const torch::optim::SGDParamState&>(s).momentum_buffer();
}

}  // namespace

TrainingStatePieces training_state_pieces(const TrainingState& state, int64_t step, const CheckpointValues& values) {
  const Parts parts = parts_of(state);
  std::set<std::string> model_keys;
  std::vector<CheckpointTensor> tensors = module_tensors(state, parts, /*for_save=*/true, model_keys);
  CheckpointMeta meta;
  meta.step = step;
  meta.values = values;
  if (state.distributed_optimizer) {
    for (auto& t : state.distributed_optimizer->checkpoint_tensors(/*for_save=*/true)) tensors.push_back(std::move(t));
    meta.optimizer = state.distributed_optimizer->checkpoint_info();
  } else if (state.optimizer) {
    const TorchOptimizerState kind = torch_kind(*state.optimizer);
    int64_t opt_step = 0;
    for (const auto& item : state.module->named_parameters(/*recurse=*/true)) {
      auto it = state.optimizer->state().find(item.value().unsafeGetTensorImpl());
      if (it == state.optimizer->state().end()) continue;
      if (const auto* a = dynamic_cast<const torch::optim::AdamWParamState*>(it->second.get())) {
        opt_step = std::max(opt_step, a->step());
      }
      for (const std::string& name : kind.names) {
        const at::Tensor t = torch_state_tensor(*it->second, name);
        if (!t.defined()) continue;
        add_module_tensor(tensors, "optim/" + name + "/" + item.key(), t, get_placement(item.value()),
                          is_expert_param(item.value()), parts, /*for_save=*/true);
      }
    }
    meta.optimizer = {{"kind", kind.kind}, {"step", opt_step}};
  }
  return {parts.mesh, std::move(meta), std::move(tensors)};
}

CheckpointMesh checkpoint_mesh_of(const TrainingState& state) { return parts_of(state).mesh; }

std::string save_checkpoint(const TrainingState& state, const std::string& dir, int64_t step,
                            const CheckpointValues& values, const CheckpointSaveOptions& options) {
  const TrainingStatePieces pieces = training_state_pieces(state, step, values);
  return save_checkpoint_files(pieces.mesh, dir, pieces.meta, pieces.tensors, options);
}

LoadedCheckpoint load_checkpoint(const TrainingState& state, const std::string& dir, std::optional<int64_t> step) {
  const Parts parts = parts_of(state);
  if (state.distributed_optimizer) state.distributed_optimizer->finish_param_sync();
  // The model's keys: this rank's, or with experts every rank's (each EP rank holds its own experts).
  std::set<std::string> model_keys;
  for (const auto& item : state.module->named_parameters(/*recurse=*/true)) model_keys.insert("model/" + item.key());
  for (const auto& item : state.module->named_buffers(/*recurse=*/true)) model_keys.insert("model/" + item.key());
  if (parts.has_experts) model_keys = model_keys_of_every_rank(parts.mesh, model_keys);
  CheckpointReader reader(parts.mesh, dir, step);
  std::set<std::string> local_model_keys;
  std::vector<CheckpointTensor> wanted;
  size_t module_count = 0;
  const Json& saved_optimizer = reader.meta().optimizer;
  // Torch optimizer: fresh tensors, installed as its state after the commit.
  struct TorchSlot {
    at::Tensor param;
    std::vector<at::Tensor> tensors;
  };
  std::vector<TorchSlot> torch_slots;
  int64_t optimizer_step = 0;
  // A rank that fails here (its optimizer or model differs) tells the others, which are in read().
  try {
    // Not mid-step: the next step would apply the old params' gradients to the loaded ones.
    state.ddp->grad_buffer()->check_no_sync_pending("meshddp::load_checkpoint");
    wanted = module_tensors(state, parts, /*for_save=*/false, local_model_keys);
    module_count = wanted.size();
    if (state.distributed_optimizer) {
      state.distributed_optimizer->check_checkpoint_info(saved_optimizer, reader.path());
      for (auto& t : state.distributed_optimizer->checkpoint_tensors(/*for_save=*/false))
        wanted.push_back(std::move(t));
      optimizer_step = json_int(json_at(saved_optimizer, "step", reader.path()), "optimizer.step");
    } else if (state.optimizer) {
      const TorchOptimizerState kind = torch_kind(*state.optimizer);
      TORCH_CHECK(!saved_optimizer.is_null(), "checkpoint '", reader.path(), "' holds no optimizer state; load it ",
                  "without an optimizer in the TrainingState, or start the optimizer afresh");
      const std::string saved_kind = json_string(json_at(saved_optimizer, "kind", reader.path()), "optimizer.kind");
      TORCH_CHECK(saved_kind == kind.kind, "checkpoint '", reader.path(), "' holds ", saved_kind,
                  " state but this optimizer is ", kind.kind);
      optimizer_step = json_int(json_at(saved_optimizer, "step", reader.path()), "optimizer.step");
      for (const auto& item : state.module->named_parameters(/*recurse=*/true)) {
        if (!item.value().requires_grad()) continue;
        TorchSlot slot{item.value(), {}};
        for (const std::string& name : kind.names) {
          const std::string key = "optim/" + name + "/" + item.key();
          at::Tensor t = at::zeros_like(item.value().detach(), at::MemoryFormat::Contiguous);
          // Absent before the first step (AdamW) or without momentum (SGD): then the state stays empty.
          const bool expected = kind.kind == "adamw" ? optimizer_step > 0 : reader.has(key);
          add_module_tensor(wanted, key, t, get_placement(item.value()), is_expert_param(item.value()), parts,
                            /*for_save=*/false);
          wanted.back().optional = !expected;
          slot.tensors.push_back(t);
        }
        torch_slots.push_back(slot);
      }
    }
  } catch (const std::exception& e) {
    reader.fail(e);
  }
  const std::vector<at::Tensor> loaded = reader.read(wanted, model_keys);

  // Everyone succeeded: commit.
  commit_loaded(wanted, loaded);
  if (state.distributed_optimizer) {
    const std::vector<CheckpointTensor> opt_wanted(wanted.begin() + module_count, wanted.end());
    const std::vector<at::Tensor> opt_loaded(loaded.begin() + module_count, loaded.end());
    state.distributed_optimizer->finish_checkpoint_load(opt_wanted, opt_loaded, optimizer_step);
  } else if (state.optimizer) {
    const TorchOptimizerState kind = torch_kind(*state.optimizer);
    size_t index = module_count;
    for (const TorchSlot& slot : torch_slots) {
      bool present = true;
      for (size_t k = 0; k < slot.tensors.size(); ++k) present = present && loaded[index + k].defined();
      index += slot.tensors.size();
      void* key = slot.param.unsafeGetTensorImpl();
      state.optimizer->state().erase(key);
      if (!present) continue;
      if (kind.kind == "adamw") {
        auto s = std::make_unique<torch::optim::AdamWParamState>();
        s->step(optimizer_step);
        s->exp_avg(slot.tensors[0]);
        s->exp_avg_sq(slot.tensors[1]);
        state.optimizer->state()[key] = std::move(s);
      } else {
        auto s = std::make_unique<torch::optim::SGDParamState>();
        s->momentum_buffer(slot.tensors[0]);
        state.optimizer->state()[key] = std::move(s);
      }
    }
  }
  return {reader.path(), reader.meta().step, reader.meta().values};
}

std::optional<LoadedCheckpoint> resume_checkpoint(const TrainingState& state, const std::string& dir,
                                                  std::optional<int64_t> step) {
  const std::optional<std::string> found = agree_on_checkpoint(parts_of(state).mesh, dir, step, /*allow_none=*/true);
  if (!found) return std::nullopt;
  return load_checkpoint(state, dir, checkpoint_step_of(found->substr(found->rfind('/') + 1)));
}

}  // namespace meshddp
