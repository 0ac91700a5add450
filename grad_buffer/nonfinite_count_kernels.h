// The arithmetic of the non-finite count (nonfinite_count.h), one element at a time, and the CUDA
// entry point that runs it. Torch-free, Thrust-free and CUDA-free, so nvcc never parses ATen and the
// host compiler builds the same functors for the CPU loop that CI tests against ATen's isfinite.
// Private to grad_buffer/: callers use nonfinite_count.h.
#pragma once

#include "host_device.h"

#include <cstddef>
#include <cstdint>

namespace meshddp::nonfinite {

// The floating formats a gradient buffer holds.
enum class Format : int32_t { kFloat32, kFloat64, kBFloat16, kFloat16 };

// 1 when element i is NaN or +-Inf (all exponent bits set), else 0: a test of the bits, so it needs
// no float arithmetic, no half-precision headers, and gives the same answer on every device.
template <class Bits, Bits kExponent>
struct IsNonfinite {
  const Bits* data;
  MESHDDP_HD int64_t operator()(int64_t i) const { return (data[i] & kExponent) == kExponent ? 1 : 0; }
};
using Float32Nonfinite = IsNonfinite<uint32_t, 0x7f800000u>;
using Float64Nonfinite = IsNonfinite<uint64_t, 0x7ff0000000000000ull>;
using BFloat16Nonfinite = IsNonfinite<uint16_t, 0x7f80u>;
using Float16Nonfinite = IsNonfinite<uint16_t, 0x7c00u>;

// Calls body(functor) with the functor for `format` over `data`.
template <class Body>
void with_functor(Format format, const void* data, const Body& body) {
  switch (format) {
    case Format::kFloat32:
      body(Float32Nonfinite{static_cast<const uint32_t*>(data)});
      return;
    case Format::kFloat64:
      body(Float64Nonfinite{static_cast<const uint64_t*>(data)});
      return;
    case Format::kBFloat16:
      body(BFloat16Nonfinite{static_cast<const uint16_t*>(data)});
      return;
    case Format::kFloat16:
      body(Float16Nonfinite{static_cast<const uint16_t*>(data)});
      return;
  }
}

#ifdef MESHDDP_WITH_CUDA
// out[p] = the count over elements [offsets[p], offsets[p + 1]) for p < pieces; `offsets` (pieces + 1
// int64) and `out` in device memory. One cub::DeviceSegmentedReduce::Sum, asynchronous on `stream`
// (a cudaStream_t). Call with temp == nullptr to get the scratch size in temp_bytes, then again with
// that much scratch.
void count_pieces_cuda(Format format, const void* data, const int64_t* offsets, int64_t pieces, int64_t* out,
                       void* temp, size_t& temp_bytes, void* stream);
#endif

}  // namespace meshddp::nonfinite
