#include "checkpoint/reshard.h"

#include "checkpoint/store.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace meshddp {

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<int64_t> local_shape(const std::vector<int64_t>& global_shape, const TpSlice& slice,
                                 const std::string& what) {
  if (slice.dim < 0 || slice.tp_size == 1) return global_shape;
  TORCH_CHECK(slice.dim < static_cast<int64_t>(global_shape.size()), what, ": sharded on dim ", slice.dim,
              " but has only ", global_shape.size(), " dims");
  TORCH_CHECK(slice.tp_size > 0 && slice.tp_rank >= 0 && slice.tp_rank < slice.tp_size, what, ": bad TP rank ",
              slice.tp_rank, " of ", slice.tp_size);
  TORCH_CHECK(global_shape[slice.dim] % slice.tp_size == 0, what, ": dim ", slice.dim, " of size ",
              global_shape[slice.dim], " does not split into ", slice.tp_size, " equal TP chunks");
  std::vector<int64_t> local = global_shape;
  local[slice.dim] /= slice.tp_size;
  return local;
}

std::vector<GlobalRun> global_runs(const std::vector<int64_t>& global_shape, const TpSlice& slice, int64_t begin,
                                   int64_t end) {
  std::vector<GlobalRun> runs;
  if (begin >= end) return runs;
  if (slice.dim < 0 || slice.tp_size == 1) return {{begin, begin, end - begin}};
  const std::vector<int64_t> local = local_shape(global_shape, slice, "global_runs");
  int64_t inner = 1;
  for (size_t d = static_cast<size_t>(slice.dim) + 1; d < global_shape.size(); ++d) inner *= global_shape[d];
  const int64_t chunk = local[slice.dim];
  const int64_t slab_local = chunk * inner, slab_global = global_shape[slice.dim] * inner;
  TORCH_CHECK(end <= numel_of(local), "global_runs: range end ", end, " is past the local tensor's ", numel_of(local),
              " elements");
  for (int64_t i = begin; i < end;) {
    const int64_t outer = i / slab_local, within = i % slab_local;
    const int64_t n = std::min(end - i, slab_local - within);
    runs.push_back({outer * slab_global + slice.tp_rank * slab_local + within, i, n});
    i += n;
  }
  return runs;
}

std::vector<PieceCopy> plan_copies(const std::vector<int64_t>& global_shape, const std::vector<Piece>& saved,
                                   const Piece& wanted) {
  const std::vector<GlobalRun> want = global_runs(global_shape, wanted.slice, wanted.begin, wanted.end);
  std::vector<PieceCopy> copies;
  for (size_t s = 0; s < saved.size(); ++s) {
    const std::vector<GlobalRun> have = global_runs(global_shape, saved[s].slice, saved[s].begin, saved[s].end);
    size_t i = 0, j = 0;
    while (i < want.size() && j < have.size()) {
      const int64_t lo = std::max(want[i].global_begin, have[j].global_begin);
      const int64_t hi = std::min(want[i].global_begin + want[i].numel, have[j].global_begin + have[j].numel);
      if (lo < hi) {
        PieceCopy c{static_cast<int64_t>(s), have[j].local_begin + (lo - have[j].global_begin) - saved[s].begin,
                    want[i].local_begin + (lo - want[i].global_begin) - wanted.begin, hi - lo};
        PieceCopy* last = copies.empty() ? nullptr : &copies.back();
        if (last && last->source == c.source && last->source_offset + last->numel == c.source_offset &&
            last->dest_offset + last->numel == c.dest_offset) {
          last->numel += c.numel;
        } else {
          copies.push_back(c);
        }
      }
      if (want[i].global_begin + want[i].numel <= have[j].global_begin + have[j].numel) {
        ++i;
      } else {
        ++j;
      }
    }
  }
  return copies;
}

int64_t covered_numel(const std::vector<PieceCopy>& copies) {
  int64_t n = 0;
  for (const PieceCopy& c : copies) n += c.numel;
  return n;
}

std::pair<int64_t, int64_t> even_split(int64_t numel, int64_t part, int64_t parts) {
  const int64_t base = numel / parts, extra = numel % parts;
  const int64_t begin = part * base + std::min(part, extra);
  return {begin, begin + base + (part < extra ? 1 : 0)};
}

}  // namespace meshddp
