#include "grad_buffer/run_stats.h"

#include "mesh/collectives.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <mutex>

namespace meshddp {

void all_reduce_over_run(const SyncGroups& groups, const at::Tensor& stats, const std::string& what) {
  all_reduce_sum_now(groups.stats_group(), stats, what);
  if (groups.has_pipeline()) all_reduce_sum_now(*groups.pipeline, stats, what + ", over the pipeline stages");
}

std::vector<std::string> all_gather_over_run(const SyncGroups& groups, const std::string& text, const std::string& what,
                                             c10::Device device) {
  std::vector<std::string> stage = all_gather_strings(groups.stats_group(), text, what, device);
  if (!groups.has_pipeline()) return stage;
  std::string joined;  // this stage's texts, one per rank, concatenated: the stages' joined in turn
  for (const std::string& part : stage) joined += part;
  return all_gather_strings(*groups.pipeline, joined, what + ", over the pipeline stages", device);
}

std::string describe_stage(const SyncGroups& groups) {
  if (!groups.has_pipeline()) return "";
  return "pipeline stage " + std::to_string(groups.pipeline->getRank()) + " of " +
         std::to_string(groups.pipeline->getSize()) + ", ";
}

std::string describe_rank(const SyncGroups& groups) {
  return describe_stage(groups) + "rank " + std::to_string(groups.stats_group().getRank()) +
         (groups.has_pipeline() ? " of the stage" : "") + " (DP rank " + std::to_string(groups.data_parallel_rank());
}

namespace {

std::mutex& registry_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::map<const void*, int64_t>& registry() {
  static std::map<const void*, int64_t> chunks;
  return chunks;
}

}  // namespace

void declare_pipeline_chunks(const void* buffer, int64_t chunks_per_rank) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  if (chunks_per_rank <= 1) {
    registry().erase(buffer);
  } else {
    registry()[buffer] = chunks_per_rank;
  }
}

void forget_pipeline_chunks(const void* buffer) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().erase(buffer);
}

int64_t pipeline_chunks_of(const void* buffer) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(buffer);
  return it == registry().end() ? 1 : it->second;
}

void check_every_chunk_given(const SyncGroups& groups, const std::vector<const void*>& buffers, const std::string& who,
                             const std::string& remedy) {
  int64_t held = 1;
  for (const void* buffer : buffers) held = std::max(held, pipeline_chunks_of(buffer));
  const auto given = static_cast<int64_t>(buffers.size());
  TORCH_CHECK(held <= given, who, ": this rank (", describe_stage(groups), "rank ", groups.stats_group().getRank(),
              " of the stage) holds ", held, " model chunks of the pipeline (DdpConfig::virtual_pipeline_size, or ",
              "the PipelineStage's stages per rank) but ", given,
              " were given: the gradient norm, clipping and the non-finite skip of a pipeline cover every chunk of ",
              "every stage, and a chunk's own would be that chunk's alone. ", remedy);
}

bool same_on_every_rank(double sum, double sum_of_squares, int64_t ranks) {
  return static_cast<double>(ranks) * sum_of_squares == sum * sum;
}

int64_t ranks_in_run(const SyncGroups& groups) {
  return groups.stats_group().getSize() * (groups.has_pipeline() ? groups.pipeline->getSize() : 1);
}

}  // namespace meshddp
