// Agreement across ranks: at the start of training every DP rank must hold the same parameters
// (names, shapes, dtypes, in the same order) and the same settings, and then they take DP rank 0's
// values (and TP ranks TP rank 0's replicated ones); during training, TP replicas must stay
// identical. All are collectives over the group they are given: every rank of it must call them,
// in the same order.
#pragma once

#include "../grad_buffer/named_param.h"  // NamedTensor
#include "../mesh/config_fields.h"       // Setting, verify_same_settings_across_ranks

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <string>
#include <vector>

namespace meshddp {

// Compares every DP rank's list with DP rank 0's; on any difference, every rank throws the same
// error naming the first differing entry, the DP ranks, and expected vs actual. `global_ranks`
// (optional) maps DP rank -> global rank for the message. `what` is e.g. "parameters".
void verify_same_tensors_across_ranks(c10d::ProcessGroup& dp_group, const std::vector<NamedTensor>& tensors,
                                      const std::string& what, const std::vector<int64_t>& global_ranks = {});

// How broadcast_from_group_rank0 splits its tensors (Note [Broadcast without staging copies],
// model_sync.cpp); tests make them small.
struct BroadcastChunking {
  int64_t in_place_bytes = int64_t{4} << 20;  // a tensor this large or larger is broadcast in place
  int64_t chunk_bytes = int64_t{32} << 20;    // smaller ones are packed into chunks of at most this
};

// Overwrites every tensor with group rank 0's values: large tensors broadcast in place, small ones
// packed into chunks of one dtype and device, so no rank holds a second copy of them all. `what`
// names them in errors.
void broadcast_from_group_rank0(c10d::ProcessGroup& group, const std::vector<NamedTensor>& tensors,
                                const std::string& what, const BroadcastChunking& chunking = {});

// The module buffers' broadcast before a step's first training forward (broadcast_buffers): every
// tensor takes group rank 0's values, but is written only where its bits differ. A buffer that already
// holds rank 0's values (a constant table, such as a rotary embedding's) is never written, on any
// rank, so no forward that saved it for backward is invalidated. Broadcasts a copy of the tensors
// (their bytes once more, while it runs). Rank 0's tensors are never written.
void broadcast_changed_from_group_rank0(c10d::ProcessGroup& group, const std::vector<NamedTensor>& tensors,
                                        const std::string& what);

// Bit-exact checksum (sum of each element's bits as an integer) of every tensor, compared across
// `tp_group`; every rank throws the same error naming the first tensor whose TP replicas differ,
// each TP rank's checksum, and `step`. For params every TP rank must hold identically.
void verify_tp_replicas_identical(c10d::ProcessGroup& tp_group, const std::vector<NamedTensor>& tensors, int64_t step);

}  // namespace meshddp
