// Resharding arithmetic for checkpoints: where a rank's piece of a tensor sits in the whole
// (global) tensor, and which element ranges of saved pieces fill a wanted piece, across any change
// of DP and TP sizes. Pure host logic over shapes and integers: no tensors, no files, no
// communication.
//
// Note [Pieces in global coordinates]
// A piece is a flat element range [begin, end) of a rank's *local* tensor, which is the global
// tensor itself (TP slice with dim -1) or chunk tp_rank of tp_size equal chunks along dim `dim`
// (mesh/placement.h's Shard). Seen as (outer, D, inner) with D = global_shape[dim], the local tensor
// is (outer, D / tp_size, inner), so a local flat range maps to runs of contiguous global elements,
// at most one per outer index it touches (one run in all for dim 0 or no TP). Resharding is then the
// intersection of sorted run lists: the wanted piece's runs against each saved piece's runs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace meshddp {

struct TpSlice {
  int64_t dim = -1;  // the sharded dim; -1: the whole tensor (Replicate, PartialGrad, or TP 1)
  int64_t tp_size = 1;
  int64_t tp_rank = 0;
  bool operator==(const TpSlice& o) const { return dim == o.dim && tp_size == o.tp_size && tp_rank == o.tp_rank; }
};

// The local tensor's shape; throws naming `what` if dim is out of range or does not divide.
std::vector<int64_t> local_shape(const std::vector<int64_t>& global_shape, const TpSlice& slice,
                                 const std::string& what);
int64_t numel_of(const std::vector<int64_t>& shape);

struct GlobalRun {
  int64_t global_begin = 0;  // first element, flat index into the global tensor
  int64_t local_begin = 0;   // the same element's flat index into the local tensor
  int64_t numel = 0;
};

// The global runs of local elements [begin, end), in increasing order (both global and local).
std::vector<GlobalRun> global_runs(const std::vector<int64_t>& global_shape, const TpSlice& slice, int64_t begin,
                                   int64_t end);

struct Piece {
  TpSlice slice;
  int64_t begin = 0, end = 0;  // local flat range
};

struct PieceCopy {
  int64_t source = -1;        // index into the saved pieces
  int64_t source_offset = 0;  // elements from the saved piece's begin
  int64_t dest_offset = 0;    // elements from the wanted piece's begin
  int64_t numel = 0;
};

// The copies that fill `wanted` from `saved` (all pieces of one global tensor), merged where
// contiguous on both sides. Saved pieces must not overlap each other; elements of `wanted` that no
// saved piece holds are simply not covered (covered_numel() tells).
std::vector<PieceCopy> plan_copies(const std::vector<int64_t>& global_shape, const std::vector<Piece>& saved,
                                   const Piece& wanted);
int64_t covered_numel(const std::vector<PieceCopy>& copies);

// The even split of `numel` elements over `parts` ranks: part p's [begin, end) (the first numel %
// parts parts get one more). Used for tensors replicated over DP, so each DP rank writes a share.
std::pair<int64_t, int64_t> even_split(int64_t numel, int64_t part, int64_t parts);

}  // namespace meshddp
