// The CUDA build of the non-finite count: nonfinite_count_kernels.h's functor over a counting
// iterator, one cub::DeviceSegmentedReduce::Sum over the pieces (a thread block per piece; pieces
// are at most kNonfinitePiece elements, so a bucket holding one huge param still spreads over the
// GPU), asynchronous on the caller's stream. Torch-free: nonfinite_count.cpp passes the stream and
// allocates the scratch.
#include "grad_buffer/nonfinite_count_kernels.h"

#include <cub/device/device_segmented_reduce.cuh>
#include <cuda_runtime.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/transform_iterator.h>

#include <stdexcept>
#include <string>

namespace meshddp::nonfinite {

void count_pieces_cuda(Format format, const void* data, const int64_t* offsets, int64_t pieces, int64_t* out,
                       void* temp, size_t& temp_bytes, void* stream) {
  cudaError_t rc = cudaSuccess;
  with_functor(format, data, [&](const auto& is_nonfinite) {
    const auto counts = thrust::make_transform_iterator(thrust::counting_iterator<int64_t>(0), is_nonfinite);
    rc = cub::DeviceSegmentedReduce::Sum(temp, temp_bytes, counts, out, pieces, offsets, offsets + 1,
                                         static_cast<cudaStream_t>(stream));
  });
  if (rc != cudaSuccess) {
    throw std::runtime_error(std::string("meshddp non-finite count: cub::DeviceSegmentedReduce::Sum failed: ") +
                             cudaGetErrorString(rc));
  }
}

}  // namespace meshddp::nonfinite
