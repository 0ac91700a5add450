// BucketStoragePool: the few bucket-sized gradient buffers that hold whole buckets while they are in
// flight under the "optim_grads" sharding strategy (grad_buffer/grad_shards.cpp), reused as backward
// proceeds. One kind per flat buffer of the layout (its grad dtype and device), each of the size of
// that buffer's largest bucket. Allocation and bookkeeping only: no communication, no policy on when
// to wait (GradBuffer decides that).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace meshddp {

class BucketStoragePool {
 public:
  // Adds a kind (its index is the number of kinds before it): blocks of `capacity` elements of `options`.
  void add_kind(int64_t capacity, at::TensorOptions options);
  // A block of kind `kind`: a free one, or a new one when none is free. Its values are unspecified.
  at::Tensor acquire(int64_t kind);
  // Gives back a block acquire(kind) returned.
  void release(int64_t kind, at::Tensor block);
  int64_t free_blocks(int64_t kind) const { return static_cast<int64_t>(kinds_[kind].free.size()); }
  int64_t allocated_blocks(int64_t kind) const { return kinds_[kind].allocated; }
  // Bytes of every block allocated so far (free or in use): the pool's resident size.
  int64_t bytes() const;

 private:
  struct Kind {
    int64_t capacity = 0;
    at::TensorOptions options;
    std::vector<at::Tensor> free;
    int64_t allocated = 0;
  };
  std::vector<Kind> kinds_;
};

}  // namespace meshddp
