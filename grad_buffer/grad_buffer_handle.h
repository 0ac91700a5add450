// GradBufferHandle: the view of a GradBuffer that a wrapped model hands out, declared without the
// GradBuffer itself (grad_buffer/grad_buffer.h), so that the public headers which pass it along
// (DistributedDataParallel, DistributedOptimizer) do not reach the buffer's internals.
#pragma once

namespace meshddp {

class GradBuffer;
class ParamBuffer;

// What a wrapped model hands its users (DdpEngine::grad_buffer(): the optimizer, the Python
// binding, checkpoints, benchmarks): the GradBuffer read-only (layout, params, placements, groups,
// the reduced gradients and their counts), its ZeRO-1 param buffer, and the one action an
// optimizer's step begins with. Hooks, zeroing, micro-batch and comm-hook settings stay with the
// owner. Valid while the GradBuffer lives.
class GradBufferHandle {
 public:
  GradBufferHandle(GradBuffer& buffer) : buffer_(&buffer) {}  // NOLINT(google-explicit-constructor)
  const GradBuffer& operator*() const { return *buffer_; }
  const GradBuffer* operator->() const { return buffer_; }
  operator const GradBuffer&() const { return *buffer_; }  // NOLINT(google-explicit-constructor)
  // GradBuffer::finish_grad_sync(): a no-op once this step's sync is done.
  void finish_grad_sync() const;
  ParamBuffer* param_buffer() const;

 private:
  GradBuffer* buffer_;
};

}  // namespace meshddp
