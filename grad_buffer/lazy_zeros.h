// Zero-filled flat buffers that cost nothing to make: on CPU, a large buffer is an anonymous mmap,
// whose pages the kernel hands out zeroed on first touch, so construction neither writes nor makes
// resident the gradient (or ZeRO-1 param) buffer; the first backward touches it, as torch DDP's
// first backward touches the buckets it allocated with torch.empty. Elsewhere (CUDA), or when small
// or when mmap fails, at::zeros.
#pragma once

#include <ATen/core/Tensor.h>

namespace meshddp {

// A 1-D tensor of `numel` zeros with `options` (dtype, device).
at::Tensor lazy_zeros(int64_t numel, const at::TensorOptions& options);

}  // namespace meshddp
