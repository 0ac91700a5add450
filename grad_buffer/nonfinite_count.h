// Counting the NaN/Inf values of a bucket's local gradient, by param, in one read of the bucket and
// without a host sync on CUDA. GradBuffer counts each bucket just before its collective (afterwards
// every rank's copy is the reduced one and the rank that produced a NaN is gone): the distributed
// optimizer reads the bucket totals to skip a step, check_for_nan_in_grad the counts by param to
// name the culprit, both after finish_grad_sync(), so backward never waits for the device.
//
// A bucket is cut into pieces: each param's range (extended over the padding up to the next param,
// which is zeros) cut into runs of at most kNonfinitePiece elements. A piece counts for one param; on
// CUDA each piece is one thread block of a segmented reduction, so a bucket that holds one huge
// param (an embedding) still spreads over every SM.
#pragma once

#include "bucket_layout.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace meshddp {

constexpr int64_t kNonfinitePiece = 1 << 16;

struct NonfinitePieces {
  std::vector<int64_t> offsets;  // pieces + 1 element offsets from the bucket's start: 0 first, its numel last
  std::vector<int64_t> param;    // per piece, the param index (into the layout's slots) it counts for
  int64_t size() const { return static_cast<int64_t>(param.size()); }
};

// The pieces of bucket `bucket` of `layout`, pieces at most `max_piece` (>= 1) elements. Pure.
NonfinitePieces nonfinite_pieces(const BucketLayout& layout, int64_t bucket, int64_t max_piece = kNonfinitePiece);

// Per piece, the number of NaN/Inf elements of `data` (a contiguous 1-D fp32, fp64, bf16 or fp16
// tensor) in [offsets[p], offsets[p + 1]), as an int64 tensor on data's device. `offsets` is
// NonfinitePieces::offsets as an int64 tensor on data's device, its last value data.numel().
// CUDA: asynchronous on the current stream. CPU: one vectorized sum proves the common case (a sum
// of finite values is finite, or overflows, which then counts exactly); only a non-finite sum
// counts element by element. Other dtypes: ATen's isfinite per piece (slower, same counts).
at::Tensor count_nonfinite_pieces(const at::Tensor& data, const at::Tensor& offsets);

}  // namespace meshddp
