#include "grad_buffer/run_stats.h"

#include "mesh/collectives.h"

#include <c10/util/Exception.h>

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

// Keyed by the pipeline group's address: every chunk of a rank is built from one mesh, hence one group.
std::map<const c10d::ProcessGroup*, int64_t>& registry() {
  static std::map<const c10d::ProcessGroup*, int64_t> chunks;
  return chunks;
}

}  // namespace

void register_pipeline_chunk(const SyncGroups& groups) {
  if (!groups.has_pipeline()) return;
  std::lock_guard<std::mutex> lock(registry_mutex());
  ++registry()[groups.pipeline.get()];
}

void unregister_pipeline_chunk(const SyncGroups& groups) {
  if (!groups.has_pipeline()) return;
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(groups.pipeline.get());
  if (it == registry().end()) return;
  if (--it->second <= 0) registry().erase(it);
}

int64_t pipeline_chunks_held(const SyncGroups& groups) {
  if (!groups.has_pipeline()) return 0;
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(groups.pipeline.get());
  return it == registry().end() ? 0 : it->second;
}

void check_every_chunk_given(const SyncGroups& groups, int64_t given, const std::string& who,
                             const std::string& remedy) {
  const int64_t held = pipeline_chunks_held(groups);
  TORCH_CHECK(held <= given, who, ": this rank (", describe_stage(groups), "rank ", groups.stats_group().getRank(),
              " of the stage) holds ", held, " model chunks on the pipeline but ", given,
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
