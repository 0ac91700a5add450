// The data-parallel side of a pipeline schedule (docs/guide/pipelines.md): what a 1F1B or interleaved
// schedule calls once per step, after the last backward micro-batch of every model chunk and before
// the optimizer step. The schedule itself (who sends what to which stage when) is the trainer's
// (examples/); the per-micro-batch controls are DdpEngine's (start_grad_sync,
// set_requires_gradient_sync, scale_gradients).
#pragma once

#include "distributed_data_parallel.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <optional>
#include <vector>

namespace meshddp {

struct FinalizeOptions {
  // Per-token loss normalisation (Megatron's calculate_per_token_loss): the loss each rank
  // backpropagated is the SUM over its valid tokens, and this is how many valid tokens this rank's
  // micro-batches held this step. The gradients are then divided by the global count, summed over
  // the DP (x CP) group, instead of being a DP mean of per-micro-batch means. Unset: the DP mean as
  // the buckets left it.
  std::optional<int64_t> num_tokens;
  // Where only the last pipeline stage knows the count (it computes the loss): the pipeline's PP
  // group; every rank then takes its last rank's num_tokens (a broadcast) before the DP sum. Null:
  // each rank's own num_tokens is used.
  c10::intrusive_ptr<c10d::ProcessGroup> pp_group = {};
};

// Finishes the gradient sync of every chunk this rank holds (chunk 0 first; a chunk whose sync was
// not started is launched and finished here), which includes the sum over the embedding group of the
// weights tied across stages (their own bucket, before the DP reduction) and the sum over TP of
// TP-partial (sequence-parallel) gradients (their buckets' all-reduce over the stage's world, done
// once). With options.num_tokens, then scales every chunk's buffers by D / (global token count).
// Returns the global token count (-1 without num_tokens). Throws, before any collective, naming the
// problem when `chunks` is empty, holds a null or repeated chunk, or does not list the chunks
// 0..V-1 (DdpConfig::virtual_pipeline_size / _chunk) in order.
// `chunks`: DistributedDataParallel<M>* convert (DdpEngine is its module-independent base).
int64_t finalize_model_grads(const std::vector<DdpEngine*>& chunks, const FinalizeOptions& options = {});

// Megatron's bucket policy per chunk: DP sync is on the critical path only on the first stage's
// chunk 0 (it finishes its backward last), so that chunk keeps `config`'s buckets (overlapped with
// its backward) and every other chunk gets one bucket (launched by start_grad_sync() in the bubble).
// Returns `config` with bucket_bytes set accordingly, virtual_pipeline_size = num_chunks and
// virtual_pipeline_chunk = chunk.
DdpConfig pipeline_chunk_config(DdpConfig config, int64_t pp_rank, int64_t chunk, int64_t num_chunks);

}  // namespace meshddp
