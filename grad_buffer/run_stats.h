// What a training run agrees on beyond one pipeline stage: the sums and reports behind gradient
// norms, clipping and non-finite checks run over the stage (SyncGroups::stats_group) and then over
// the pipeline (SyncGroups::pipeline), so that a pipeline is one run (docs/guide/pipelines.md). And the
// count of GradBuffers this process holds on each pipeline, so that a norm or a step over fewer
// chunks than this rank holds is refused instead of giving a per-chunk number.
#pragma once

#include "bucket_reduction.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace meshddp {

// In-place sum of `stats` over the stats group, then over the pipeline group (when there is one).
// Every rank of the whole run must call it, with the same shape.
void all_reduce_over_run(const SyncGroups& groups, const at::Tensor& stats, const std::string& what);

// Every rank's `text` of the whole run, on every rank: stage by stage (pipeline rank order), within a
// stage in stats-group rank order.
std::vector<std::string> all_gather_over_run(const SyncGroups& groups, const std::string& text, const std::string& what,
                                             c10::Device device = c10::Device(c10::kCPU));

// "pipeline stage 1 of 2, " (with a pipeline) or "" (without): where a report line comes from.
std::string describe_stage(const SyncGroups& groups);
// "rank 3 (DP rank 1" or, with a pipeline, "pipeline stage 1 of 2, rank 3 of the stage (DP rank 1": a
// report line's start, its parenthesis left open for more.
std::string describe_rank(const SyncGroups& groups);

// How many model chunks each rank of the pipeline holds, declared for a chunk's GradBuffer (keyed by
// its address): DdpConfig::virtual_pipeline_size (DistributedDataParallel declares it), or the stages
// per rank of a torch schedule (meshddp.pipelining.PipelineStage). Undeclared: 1. A GradBuffer's
// destructor forgets it. A norm or a step over fewer chunks than one of them declares is refused:
// it would be those chunks' alone. Other models on the same mesh (a frozen reference, a critic) are
// not counted.
void declare_pipeline_chunks(const void* buffer, int64_t chunks_per_rank);
void forget_pipeline_chunks(const void* buffer);
int64_t pipeline_chunks_of(const void* buffer);

// Throws, naming `who`, the counts and `remedy`, when `buffers` (the chunks given to one norm or
// step) are fewer than one of them declares.
void check_every_chunk_given(const SyncGroups& groups, const std::vector<const void*>& buffers, const std::string& who,
                             const std::string& remedy);

// Whether every rank of the whole run passed the same `count` (e.g. of chunks), from the sums over
// the run of count and count^2 (equal iff N * sum(c^2) == sum(c)^2, N the run's ranks).
bool same_on_every_rank(double sum, double sum_of_squares, int64_t ranks);

// The number of ranks of the whole run (stats group size x pipeline size).
int64_t ranks_in_run(const SyncGroups& groups);

}  // namespace meshddp
