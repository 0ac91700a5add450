// GradBuffer's controls for a pipeline schedule (docs/guide/pipelines.md): start a step's sync now, scale
// the buffers, and the step's sync state.
#include "grad_buffer/grad_buffer.h"

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <cmath>

namespace meshddp {

void GradBuffer::start_grad_sync() {
  check_trainable_params_unchanged("start_grad_sync()");
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_ == StepState::kSynced) return;
  while (next_bucket_ < static_cast<int64_t>(buckets_.size())) launch_bucket(next_bucket_++);
}

void GradBuffer::scale_gradients(double factor) {
  TORCH_CHECK(std::isfinite(factor), "GradBuffer::scale_gradients: the factor is ", factor,
              "; give a finite number (e.g. 1 / the global token count)");
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t in_flight = 0;
  for (const Bucket& b : buckets_) in_flight += (b.launched && state_ != StepState::kSynced) ? 1 : 0;
  TORCH_CHECK(in_flight == 0, "GradBuffer::scale_gradients: ", in_flight, " bucket collective(s) of this step ",
              "are in flight (launched, not yet waited for); scale between micro-batches (before the last one's ",
              "sync starts) or after finish_grad_sync(), not while the buckets are being reduced");
  c10::NoGradGuard no_grad;
  if (shards_grads_) {  // the micro-batches reduced so far, and the current one's buckets not yet launched
    for (at::Tensor& shards : shard_buffers_) shards.mul_(factor);
    for (Bucket& bucket : buckets_) {
      if (bucket.storage.defined()) bucket.storage.mul_(factor);
    }
    return;
  }
  for (at::Tensor& buffer : buffers_) buffer.mul_(factor);
}

bool GradBuffer::grad_sync_finished() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return state_ == StepState::kSynced;
}

bool GradBuffer::grad_sync_started() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return state_ != StepState::kIdle;
}

}  // namespace meshddp
