// The pieces of a training state's checkpoint, gathered without writing anything: what
// save_checkpoint stores (plugin/training_checkpoint.h), for CheckpointSaver, which writes it later
// (plugin/checkpoint_saver.h). Internal: not installed.
#pragma once

#include "../checkpoint/store.h"
#include "training_checkpoint.h"

#include <cstdint>
#include <vector>

namespace meshddp {

// The tensors are views of the live state.
struct TrainingStatePieces {
  CheckpointMesh mesh;
  CheckpointMeta meta;
  std::vector<CheckpointTensor> tensors;
};
TrainingStatePieces training_state_pieces(const TrainingState& state, int64_t step, const CheckpointValues& values);
// The group a checkpoint of `state` agrees over (the whole mesh) and the ranks its manifest records.
CheckpointMesh checkpoint_mesh_of(const TrainingState& state);

// The same for a pipeline rank's chunks (over state.world).
TrainingStatePieces training_state_pieces(const PipelineTrainingState& state, int64_t step,
                                          const CheckpointValues& values);
CheckpointMesh checkpoint_mesh_of(const PipelineTrainingState& state);

}  // namespace meshddp
