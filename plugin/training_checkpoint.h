// Checkpoints of a whole training state, with or without the ZeRO-1 DistributedOptimizer: the
// module's params (frozen ones too) and buffers, the optimizer's state and step, and user values
// (data position, LR schedule, ...). Crash-safe, checksummed, all-or-nothing over the whole mesh,
// loadable at any other DP x TP. The layout and commit protocol: checkpoint/store.h; the
// format and guarantees: docs/reference/checkpoints.md.
//
//   meshddp::TrainingState state{&ddp.module(), &ddp, &zero_optimizer};   // or {..., nullptr, &adamw}
//   meshddp::save_checkpoint(state, "ckpt", step, {{"data_position", step * batch}});
//   auto loaded = meshddp::load_checkpoint(state, "ckpt");             // latest complete; loaded.step
#pragma once

#include "../checkpoint/checkpoint_values.h"
#include "../checkpoint/save_options.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <optional>
#include <string>
#include <vector>

namespace meshddp {

class DdpEngine;             // plugin/distributed_data_parallel.h
class DistributedOptimizer;  // optimizer/distributed_optimizer.h

struct TrainingState {
  torch::nn::Module* module = nullptr;  // required: params (trainable and frozen) and buffers
  DdpEngine* ddp = nullptr;             // required: its groups say who writes what, and agree over the mesh
  DistributedOptimizer* distributed_optimizer = nullptr;  // ZeRO-1: saves trainable params and state; or
  torch::optim::Optimizer* optimizer = nullptr;           // torch::optim::AdamW or SGD over the module's params
                                                          // (replicated over DP); or neither: model only
};

// Collective over every rank of the mesh: writes <dir>/step-<step>/ and moves <dir>/latest to it.
// `values` (world rank 0's) are stored in the manifest. Returns the step directory. Throws on every
// rank, with every failing rank's error, if any rank fails; then nothing is committed.
std::string save_checkpoint(const TrainingState& state, const std::string& dir, int64_t step,
                            const CheckpointValues& values = {}, const CheckpointSaveOptions& options = {});

struct LoadedCheckpoint {
  std::string path;         // <dir>/step-<N>
  int64_t step = 0;         // the step given to save_checkpoint
  CheckpointValues values;  // as saved
};

// Collective: loads `dir`'s latest complete checkpoint (or step-<step>) into the state, at this
// run's DP x TP, whatever the saved one was. Checks everything (files, checksums, the model: a
// param or buffer missing, extra or reshaped is named) on every rank before anything changes; on
// any failure every rank throws and no rank's state has changed.
LoadedCheckpoint load_checkpoint(const TrainingState& state, const std::string& dir,
                                 std::optional<int64_t> step = std::nullopt);

// Collective, for resuming a run: as load_checkpoint (of the live run's newest, or step-<step>), but
// returns nullopt, changing nothing, when every rank finds no checkpoint at all in `dir` (missing, or
// no complete step and no `latest`): a fresh start. Checkpoints that exist but cannot be loaded (a
// damaged `latest`, corrupt files) and ranks that see different directories throw on every rank.
std::optional<LoadedCheckpoint> resume_checkpoint(const TrainingState& state, const std::string& dir,
                                                  std::optional<int64_t> step = std::nullopt);

// Pipeline parallel: a rank holds several model chunks (a stage, or several with virtual stages), each
// with its own DistributedDataParallel (and DistributedOptimizer, or one torch optimizer shared by all
// chunks), and the stages hold different params. Params are saved and found by name, so chunks must
// use the model's global names ("blocks.5.attn.q.weight" on whichever stage holds layer 5): then a
// checkpoint saved at one pipeline size loads at another (and at any DP x TP), as for TP. A weight tied
// across stages is saved under each copy's name ("wte.weight", "lm_head.weight"); a model that ties
// them in one module registers the tensor under both names.
struct PipelineTrainingState {
  std::vector<TrainingState> chunks;  // this rank's chunks; every one has the same kind of optimizer
  // Every rank of the mesh (all stages): saves and loads agree over it, and each rank writes its file
  // in it. Required: a chunk's DDP only knows its stage.
  c10::intrusive_ptr<c10d::ProcessGroup> world;
};
// The same collectives over state.world, for a pipeline rank's chunks.
std::string save_checkpoint(const PipelineTrainingState& state, const std::string& dir, int64_t step,
                            const CheckpointValues& values = {}, const CheckpointSaveOptions& options = {});
LoadedCheckpoint load_checkpoint(const PipelineTrainingState& state, const std::string& dir,
                                 std::optional<int64_t> step = std::nullopt);
std::optional<LoadedCheckpoint> resume_checkpoint(const PipelineTrainingState& state, const std::string& dir,
                                                  std::optional<int64_t> step = std::nullopt);

}  // namespace meshddp
