#include "plugin/training_checkpoint.h"

#include "checkpoint/store.h"
#include "grad_buffer/grad_buffer.h"
#include "mesh/placement.h"
#include "optimizer/distributed_optimizer.h"
#include "plugin/distributed_data_parallel.h"
#include "plugin/training_state_pieces.h"

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

// The chunks of a pipeline rank (one for a plain TrainingState), and the group saves agree over.
struct Chunks {
  std::vector<TrainingState> states;
  c10::intrusive_ptr<c10d::ProcessGroup> world;  // null: the first chunk's DDP world (or DP group)
  bool pipeline = false;                         // stages hold different params: gather the model keys
};

Parts parts_of(const Chunks& chunks) {
  TORCH_CHECK(!chunks.states.empty(), "checkpoint: PipelineTrainingState has no chunks; give one TrainingState per ",
              "model chunk this rank holds");
  for (size_t c = 0; c < chunks.states.size(); ++c) {
    const TrainingState& state = chunks.states[c];
    TORCH_CHECK(state.module && state.ddp, "checkpoint: TrainingState", chunks.pipeline ? " of chunk " : "",
                chunks.pipeline ? std::to_string(c) : "", " needs module and ddp");
    TORCH_CHECK(
        !(state.distributed_optimizer && state.optimizer),
        "checkpoint: TrainingState has both a DistributedOptimizer and a torch optimizer; give the one that steps");
    TORCH_CHECK(!state.distributed_optimizer == !chunks.states[0].distributed_optimizer &&
                    !state.optimizer == !chunks.states[0].optimizer,
                "checkpoint: chunk ", c, " has another kind of optimizer than chunk 0; every chunk needs a ",
                "DistributedOptimizer, or all share one torch optimizer, or none has one");
  }
  const SyncGroups& g = chunks.states[0].ddp->grad_buffer()->groups();
  Parts p;
  // Over the whole DP group (with K optimizer instances, `g.dp` is one instance of D/K ranks).
  p.mesh = {chunks.world ? chunks.world
            : g.world    ? g.world
                         : g.dp,
            g.data_parallel_rank(), g.data_parallel_size(), g.tp_rank, g.tp_size};
  if (chunks.world) p.mesh.pp_size = chunks.world->getSize() / (p.mesh.dp_size * p.mesh.tp_size);
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

TrainingStatePieces pieces_of(const Chunks& chunks, int64_t step, const CheckpointValues& values) {
  const Parts parts = parts_of(chunks);
  std::set<std::string> model_keys;
  std::vector<CheckpointTensor> tensors;
  for (const TrainingState& state : chunks.states) {
    for (auto& t : module_tensors(state, parts, /*for_save=*/true, model_keys)) tensors.push_back(std::move(t));
  }
  CheckpointMeta meta;
  meta.step = step;
  meta.values = values;
  int64_t opt_step = 0;
  for (const TrainingState& state : chunks.states) {
    if (state.distributed_optimizer) {
      for (auto& t : state.distributed_optimizer->checkpoint_tensors(/*for_save=*/true))
        tensors.push_back(std::move(t));
      meta.optimizer = state.distributed_optimizer->checkpoint_info();
    } else if (state.optimizer) {
      const TorchOptimizerState kind = torch_kind(*state.optimizer);
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
      meta.optimizer = CheckpointOptimizer{kind.kind, opt_step, std::nullopt};
    }
  }
  return {parts.mesh, std::move(meta), std::move(tensors)};
}

std::string save_chunks(const Chunks& chunks, const std::string& dir, int64_t step, const CheckpointValues& values,
                        const CheckpointSaveOptions& options) {
  const TrainingStatePieces pieces = pieces_of(chunks, step, values);
  return save_checkpoint_files(pieces.mesh, dir, pieces.meta, pieces.tensors, options);
}

// Torch optimizer: fresh tensors per param, installed as its state after the commit.
struct TorchSlot {
  at::Tensor param;
  std::vector<at::Tensor> tensors;
};
// Where one chunk's tensors sit in the load's `wanted` list.
struct ChunkLoad {
  size_t optimizer_begin = 0, end = 0;  // [optimizer_begin, end): the optimizer's (after the module's)
  std::vector<TorchSlot> torch_slots;
};

// One chunk's wanted tensors (the module's, then its optimizer's), appended to `wanted`.
ChunkLoad want_chunk(const TrainingState& state, const Parts& parts, const CheckpointReader& reader,
                     int64_t optimizer_step, std::set<std::string>& local_model_keys,
                     std::vector<CheckpointTensor>& wanted) {
  ChunkLoad out;
  // Not mid-step: the next step would apply the old params' gradients to the loaded ones.
  state.ddp->grad_buffer()->check_no_sync_pending("meshddp::load_checkpoint");
  for (auto& t : module_tensors(state, parts, /*for_save=*/false, local_model_keys)) wanted.push_back(std::move(t));
  out.optimizer_begin = wanted.size();
  const std::optional<CheckpointOptimizer>& saved_optimizer = reader.meta().optimizer;
  if (state.distributed_optimizer) {
    state.distributed_optimizer->check_checkpoint_info(saved_optimizer, reader.path());
    for (auto& t : state.distributed_optimizer->checkpoint_tensors(/*for_save=*/false)) wanted.push_back(std::move(t));
  } else if (state.optimizer) {
    const TorchOptimizerState kind = torch_kind(*state.optimizer);
    const std::string saved_kind = saved_optimizer ? saved_optimizer->kind : "no optimizer";
    TORCH_CHECK(saved_kind == kind.kind, "checkpoint '", reader.path(), "' holds ", saved_kind,
                " state but this optimizer is ", kind.kind);
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
      out.torch_slots.push_back(slot);
    }
  }
  out.end = wanted.size();
  return out;
}

// After the commit of the module tensors: one chunk's optimizer state from what was loaded.
void install_optimizer_state(const TrainingState& state, const ChunkLoad& chunk,
                             const std::vector<CheckpointTensor>& wanted, const std::vector<at::Tensor>& loaded,
                             int64_t optimizer_step) {
  if (state.distributed_optimizer) {
    const std::vector<CheckpointTensor> opt_wanted(wanted.begin() + chunk.optimizer_begin, wanted.begin() + chunk.end);
    const std::vector<at::Tensor> opt_loaded(loaded.begin() + chunk.optimizer_begin, loaded.begin() + chunk.end);
    state.distributed_optimizer->finish_checkpoint_load(opt_wanted, opt_loaded, optimizer_step);
    return;
  }
  if (!state.optimizer) return;
  const TorchOptimizerState kind = torch_kind(*state.optimizer);
  size_t index = chunk.optimizer_begin;
  for (const TorchSlot& slot : chunk.torch_slots) {
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

LoadedCheckpoint load_chunks(const Chunks& chunks, const std::string& dir, std::optional<int64_t> step) {
  const Parts parts = parts_of(chunks);
  // The model's keys: this rank's, or with experts (each EP rank holds its own experts) or pipeline
  // stages (each holds its own layers) every rank's.
  std::set<std::string> model_keys;
  bool experts = parts.has_experts;
  for (const TrainingState& state : chunks.states) {
    if (state.distributed_optimizer) state.distributed_optimizer->finish_param_sync();
    for (const auto& item : state.module->named_parameters(/*recurse=*/true)) model_keys.insert("model/" + item.key());
    for (const auto& item : state.module->named_buffers(/*recurse=*/true)) model_keys.insert("model/" + item.key());
    experts = experts || state.ddp->grad_buffer()->groups().expert_dp != nullptr;
  }
  if (experts || chunks.pipeline) model_keys = model_keys_of_every_rank(parts.mesh, model_keys);
  CheckpointReader reader(parts.mesh, dir, step);
  std::set<std::string> local_model_keys;
  std::vector<CheckpointTensor> wanted;
  std::vector<ChunkLoad> loads;
  int64_t optimizer_step = 0;
  // A rank that fails here (its optimizer or model differs) tells the others, which are in read().
  try {
    const std::optional<CheckpointOptimizer>& saved_optimizer = reader.meta().optimizer;
    const TrainingState& first = chunks.states[0];
    TORCH_CHECK(!first.optimizer || saved_optimizer.has_value(), "checkpoint '", reader.path(),
                "' holds no optimizer state; load it without an optimizer in the TrainingState, or start the ",
                "optimizer afresh");
    // (a DistributedOptimizer names a missing state itself: check_checkpoint_info in want_chunk)
    if ((first.distributed_optimizer || first.optimizer) && saved_optimizer) optimizer_step = saved_optimizer->step;
    for (const TrainingState& state : chunks.states) {
      loads.push_back(want_chunk(state, parts, reader, optimizer_step, local_model_keys, wanted));
    }
  } catch (const std::exception& e) {
    reader.fail(e);
  }
  const std::vector<at::Tensor> loaded = reader.read(wanted, model_keys);

  // Everyone succeeded: commit.
  commit_loaded(wanted, loaded);
  for (size_t c = 0; c < chunks.states.size(); ++c) {
    install_optimizer_state(chunks.states[c], loads[c], wanted, loaded, optimizer_step);
  }
  return {reader.path(), reader.meta().step, reader.meta().values};
}

std::optional<LoadedCheckpoint> resume_chunks(const Chunks& chunks, const std::string& dir,
                                              std::optional<int64_t> step) {
  const std::optional<std::string> found = agree_on_checkpoint(parts_of(chunks).mesh, dir, step, /*allow_none=*/true);
  if (!found) return std::nullopt;
  return load_chunks(chunks, dir, checkpoint_step_of(found->substr(found->rfind('/') + 1)));
}

Chunks one_chunk(const TrainingState& state) { return Chunks{{state}, nullptr, false}; }
Chunks pipeline_chunks(const PipelineTrainingState& state) { return Chunks{state.chunks, state.world, true}; }

}  // namespace

TrainingStatePieces training_state_pieces(const TrainingState& state, int64_t step, const CheckpointValues& values) {
  return pieces_of(one_chunk(state), step, values);
}
TrainingStatePieces training_state_pieces(const PipelineTrainingState& state, int64_t step,
                                          const CheckpointValues& values) {
  return pieces_of(pipeline_chunks(state), step, values);
}
CheckpointMesh checkpoint_mesh_of(const TrainingState& state) { return parts_of(one_chunk(state)).mesh; }
CheckpointMesh checkpoint_mesh_of(const PipelineTrainingState& state) { return parts_of(pipeline_chunks(state)).mesh; }

std::string save_checkpoint(const TrainingState& state, const std::string& dir, int64_t step,
                            const CheckpointValues& values, const CheckpointSaveOptions& options) {
  return save_chunks(one_chunk(state), dir, step, values, options);
}
LoadedCheckpoint load_checkpoint(const TrainingState& state, const std::string& dir, std::optional<int64_t> step) {
  return load_chunks(one_chunk(state), dir, step);
}
std::optional<LoadedCheckpoint> resume_checkpoint(const TrainingState& state, const std::string& dir,
                                                  std::optional<int64_t> step) {
  return resume_chunks(one_chunk(state), dir, step);
}

std::string save_checkpoint(const PipelineTrainingState& state, const std::string& dir, int64_t step,
                            const CheckpointValues& values, const CheckpointSaveOptions& options) {
  return save_chunks(pipeline_chunks(state), dir, step, values, options);
}
LoadedCheckpoint load_checkpoint(const PipelineTrainingState& state, const std::string& dir,
                                 std::optional<int64_t> step) {
  return load_chunks(pipeline_chunks(state), dir, step);
}
std::optional<LoadedCheckpoint> resume_checkpoint(const PipelineTrainingState& state, const std::string& dir,
                                                  std::optional<int64_t> step) {
  return resume_chunks(pipeline_chunks(state), dir, step);
}

}  // namespace meshddp
