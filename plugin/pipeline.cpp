#include "plugin/pipeline.h"

#include "grad_buffer/bucket_layout.h"
#include "grad_buffer/grad_buffer.h"
#include "grad_buffer/param_buffer.h"
#include "grad_buffer/param_gather.h"
#include "mesh/collectives.h"
#include "mesh/config_fields.h"
#include "mesh/pipeline_groups.h"
#include "mesh/placement.h"
#include "mesh/process_group_factory.h"
#include "plugin/model_sync.h"

#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <set>
#include <sstream>

namespace meshddp {
namespace {

std::string chunk_name(const DdpConfig& config) {
  return "chunk " + std::to_string(config.virtual_pipeline_chunk) + " of " +
         std::to_string(config.virtual_pipeline_size);
}

}  // namespace

void DdpEngine::verify_pipeline_settings(const DeviceMesh& mesh, const DdpConfig& config) {
  const auto& names = mesh.names();
  if (std::find(names.begin(), names.end(), kPipelineDim) == names.end() || !mesh.world()) return;
  // Once per rank, at its first chunk: the later chunks' constructions run no collective across
  // stages, since the first stage's chunk 0 then waits for the last stage's chunk V-1 in the tied
  // exchange (sync_tied_params_at_construction).
  if (config.virtual_pipeline_chunk != 0) return;
  ensure_cpu_backend(*mesh.world(), "DistributedDataParallel");
  verify_same_settings_across_ranks(*mesh.world(),
                                    {{"pp size", std::to_string(mesh.size(kPipelineDim))},
                                     {"virtual_pipeline_size", std::to_string(config.virtual_pipeline_size)}},
                                    "DistributedDataParallel", "the pipeline settings (at each rank's chunk 0)");
}

std::vector<NamedTensor> DdpEngine::tied_params() const {
  std::vector<NamedTensor> out;
  const BucketLayout& layout = buffer_->layout();
  for (size_t i = 0; i < buffer_->params().size(); ++i) {
    if (layout.buffers[layout.slots[i].buffer].key.tied)
      out.push_back({buffer_->params()[i].name, buffer_->params()[i].param});
  }
  return out;
}

namespace {

// Whether this chunk is the one that exchanges the tied params with the other end of the pipeline:
// the first stage's chunk 0 (embedding group rank 0) and the last stage's chunk V-1 (its last rank).
bool exchanges_tied(const SyncGroups& groups, const DdpConfig& config) {
  if (!groups.embedding || groups.embedding->getSize() == 1) return false;
  const int64_t rank = groups.embedding->getRank();
  return (rank == 0 && config.virtual_pipeline_chunk == 0) ||
         (rank == groups.embedding->getSize() - 1 && config.virtual_pipeline_chunk == config.virtual_pipeline_size - 1);
}

}  // namespace

void DdpEngine::sync_tied_params_at_construction() {
  TORCH_CHECK(config_.virtual_pipeline_chunk < config_.virtual_pipeline_size,
              "DistributedDataParallel: DdpConfig::virtual_pipeline_chunk = ", config_.virtual_pipeline_chunk,
              " must be < virtual_pipeline_size = ", config_.virtual_pipeline_size, " (chunks are 0..V-1)");
  const std::vector<NamedTensor> tied = tied_params();
  if (!groups_.embedding || groups_.embedding->getSize() == 1) return;  // one stage: the copies are one
  const bool exchanges = exchanges_tied(groups_, config_);
  if (!exchanges) {
    TORCH_CHECK(tied.empty(), "DistributedDataParallel: parameter '", tied.empty() ? "" : tied.front().name,
                "' is declared tied across stages in ", chunk_name(config_), " of pipeline stage ",
                groups_.embedding->getRank() == 0 ? "first" : "last",
                ", but a tied weight lives in the first stage's chunk 0 and the last stage's chunk V-1 ",
                "(virtual_pipeline_chunk); move it there, or do not declare it");
    return;
  }
  ensure_cpu_backend(*groups_.embedding, "DistributedDataParallel");
  std::vector<Setting> layout{{"tied params", std::to_string(tied.size())},
                              {"DP size", std::to_string(groups_.data_parallel_size())}};
  std::string names;
  for (size_t i = 0; i < tied.size(); ++i) {
    std::ostringstream v;
    v << tied[i].tensor.sizes() << " " << tied[i].tensor.scalar_type();
    layout.push_back({"tied param #" + std::to_string(i), v.str()});
    names += (i ? ", '" : "'") + tied[i].name + "'";
  }
  verify_same_settings_across_ranks(*groups_.embedding, layout, "DistributedDataParallel",
                                    "the tied-across-stages layouts of the first and last stage (this rank's: " +
                                        (names.empty() ? std::string("none") : names) + ")");
  if (config_.broadcast_from_rank0) {
    broadcast_from_group_rank0(*groups_.embedding, tied, "the tied-across-stages params (from the first stage)");
  }
}

void DdpEngine::broadcast_params() {
  buffer_->check_no_sync_pending("DistributedDataParallel::broadcast_params");
  if (ParamGather* gather = param_gather()) gather->wait_all();  // it would overwrite what we broadcast
  std::vector<NamedTensor> dense, expert;
  for (const auto& p : unique_params_) (is_expert_param(p.param) ? expert : dense).push_back({p.name, p.param});
  broadcast_from_group_rank0(*dp_group_, dense, "the parameters (broadcast_params, from DP rank 0)");
  if (groups_.expert_dp) {
    broadcast_from_group_rank0(*groups_.expert_dp, expert,
                               "the expert parameters (broadcast_params, from expert-data-parallel rank 0)");
  }
  if (exchanges_tied(groups_, config_)) {
    broadcast_from_group_rank0(*groups_.embedding, tied_params(),
                               "the tied-across-stages params (broadcast_params, from the first stage)");
  }
  if (ParamBuffer* params = buffer_->param_buffer()) params->notify_params_changed();
}

void DdpEngine::check_tied_params_identical() const {
  if (!exchanges_tied(groups_, config_)) return;
  if (ParamGather* gather = param_gather()) gather->wait_all();  // the params must be this step's
  c10::NoGradGuard no_grad;
  const std::vector<NamedTensor> tied = tied_params();
  std::vector<NamedTensor> first;  // the first stage's values, here
  for (const auto& t : tied) first.push_back({t.name, t.tensor.detach().clone()});
  broadcast_from_group_rank0(*groups_.embedding, first, "the tied-across-stages check");
  std::string mine;
  for (size_t i = 0; i < tied.size(); ++i) {
    if (at::equal(first[i].tensor, tied[i].tensor)) continue;
    const double diff = (first[i].tensor - tied[i].tensor).abs().max().item<double>();
    mine = "'" + tied[i].name + "' differs from the first stage's copy by up to " + std::to_string(diff);
    break;
  }
  const auto verdicts = all_gather_strings(*groups_.embedding, mine, "the tied-across-stages check verdict");
  for (size_t r = 0; r < verdicts.size(); ++r) {
    TORCH_CHECK(verdicts[r].empty(), "DistributedDataParallel::check_tied_params_identical: the copies of a weight ",
                "tied across pipeline stages differ: on embedding-group rank ", r, " (the ", r == 0 ? "first" : "last",
                " stage), ", verdicts[r], " (after ", buffer_->stats().syncs_completed,
                " synced step(s)). Both copies must be declared ",
                "(declare_tied_across_stages) on their stages, be updated by the same optimizer, and nothing ",
                "else may write either copy");
  }
}

namespace {

// Per-token normalisation must be chosen by every DP rank or by none: a rank that passes num_tokens
// all-reduces the count, one that does not goes on to the optimizer step, and their next collectives
// would pair wrongly (a hang, or two different tensors combined). One small all-reduce of the choice,
// every step, also without num_tokens; on a disagreement every rank fails naming each rank's choice.
void agree_on_num_tokens(c10d::ProcessGroup& dp_group, bool given) {
  at::Tensor count = at::full({1}, given ? 1 : 0, at::kLong);
  all_reduce_sum_now(dp_group, count, "whether num_tokens was given (finalize_model_grads)");
  const int64_t ranks_given = count.item<int64_t>();
  if (ranks_given == 0 || ranks_given == dp_group.getSize()) return;
  const auto choices = all_gather_strings(dp_group, given ? "num_tokens" : "none",
                                          "each rank's num_tokens choice (finalize_model_grads)");
  std::string each;
  for (size_t r = 0; r < choices.size(); ++r)
    each += (r ? ", " : "") + std::string("DP rank ") + std::to_string(r) + ": " + choices[r];
  TORCH_CHECK(false, "finalize_model_grads: ", ranks_given, " of ", dp_group.getSize(),
              " data-parallel ranks passed num_tokens (", each, "). Per-token normalisation must be chosen on every ",
              "rank alike: pass num_tokens on every rank (0 where a rank holds no valid token), or on none");
}

}  // namespace

int64_t finalize_model_grads(const std::vector<DdpEngine*>& chunks, const FinalizeOptions& options) {
  TORCH_CHECK(!chunks.empty(), "finalize_model_grads: no chunks given; pass every DistributedDataParallel this ",
              "rank holds (one per model chunk, in chunk order)");
  const auto v = static_cast<int64_t>(chunks.size());
  std::set<const DdpEngine*> seen;
  for (int64_t i = 0; i < v; ++i) {
    TORCH_CHECK(chunks[i] != nullptr, "finalize_model_grads: chunks[", i, "] is null");
    TORCH_CHECK(seen.insert(chunks[i]).second, "finalize_model_grads: chunks[", i, "] is given twice");
    const DdpConfig& c = chunks[i]->config();
    TORCH_CHECK(c.virtual_pipeline_size == v && c.virtual_pipeline_chunk == i, "finalize_model_grads: chunks[", i,
                "] is ", chunk_name(c), " (DdpConfig::virtual_pipeline_chunk / virtual_pipeline_size) but ", v,
                " chunk(s) were given; pass every chunk this rank holds, in chunk order 0..V-1 (a chunk left out ",
                "would leave its gradient sync unfinished and the other ranks waiting for it)");
  }
  for (DdpEngine* chunk : chunks) chunk->finish_grad_sync();
  agree_on_num_tokens(chunks.front()->dp_group(), options.num_tokens.has_value());
  if (!options.num_tokens) return -1;
  TORCH_CHECK(*options.num_tokens >= 0, "finalize_model_grads: num_tokens = ", *options.num_tokens,
              " is negative; give this rank's count of valid (loss-bearing) tokens this step");
  at::Tensor count = at::full({1}, *options.num_tokens, at::kLong);
  if (options.pp_group && options.pp_group->getSize() > 1) {
    ensure_cpu_backend(*options.pp_group, "finalize_model_grads");
    const std::string what = "the token count (finalize_model_grads, from the last pipeline stage)";
    wait_collective(broadcast_from(*options.pp_group, count, options.pp_group->getSize() - 1, what), *options.pp_group,
                    what);
  }
  all_reduce_sum_now(chunks.front()->dp_group(), count, "the global token count (finalize_model_grads)");
  const int64_t global = count.item<int64_t>();
  TORCH_CHECK(global > 0, "finalize_model_grads: the global token count is ", global,
              " (num_tokens summed over the DP group); a step with no valid token has no gradient to normalise");
  for (DdpEngine* chunk : chunks) {
    // The buckets divided by D (a DP mean); the loss was a sum over tokens: D / N makes it sum / N.
    const auto d = static_cast<double>(chunk->grad_buffer()->groups().data_parallel_size());
    chunk->scale_gradients(d / static_cast<double>(global));
  }
  return global;
}

DdpConfig pipeline_chunk_config(DdpConfig config, int64_t pp_rank, int64_t chunk, int64_t num_chunks) {
  TORCH_CHECK(num_chunks >= 1 && chunk >= 0 && chunk < num_chunks, "pipeline_chunk_config: chunk ", chunk, " of ",
              num_chunks, " (need 0 <= chunk < num_chunks)");
  config.virtual_pipeline_size = num_chunks;
  config.virtual_pipeline_chunk = chunk;
  if (pp_rank != 0 || chunk != 0) config.bucket_bytes = size_t{1} << 40;  // one bucket per buffer
  return config;
}

}  // namespace meshddp
