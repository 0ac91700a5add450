#include "grad_buffer/lazy_zeros.h"

#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>

#include <sys/mman.h>

namespace meshddp {
namespace {

// Below this, at::zeros: the allocator's pool is cheaper than a system call, and the fill is nothing.
constexpr size_t kMmapBytes = size_t{1} << 20;

}  // namespace

at::Tensor lazy_zeros(int64_t numel, const at::TensorOptions& options) {
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  if (options.device().type() != c10::kCPU || options.pinned_memory() || bytes < kMmapBytes) {
    return at::zeros({numel}, options);
  }
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED) return at::zeros({numel}, options);
  return at::from_blob(data, {numel}, [bytes](void* p) { munmap(p, bytes); }, options);
}

}  // namespace meshddp
