#include "examples/common/step_log.h"

#include <cmath>
#include <numeric>
#include <sys/resource.h>

#ifdef MESHDDP_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace examples {

std::string peak_memory_text(c10::Device device) {
  char text[64];
#ifdef MESHDDP_WITH_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    const auto& peak = stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
    std::snprintf(text, sizeof(text), "%.1f MiB CUDA peak allocated", static_cast<double>(peak) / (1 << 20));
    return text;
  }
#endif
  (void)device;
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);  // ru_maxrss: KiB on Linux
  std::snprintf(text, sizeof(text), "%.1f MiB RSS", static_cast<double>(usage.ru_maxrss) / 1024.0);
  return text;
}

StepLogger::StepLogger(int64_t total_steps, int64_t log_interval, int64_t samples_per_step, int64_t tokens_per_sample,
                       c10::Device device, bool enabled, std::FILE* out)
    : total_(total_steps),
      interval_(log_interval),
      samples_(samples_per_step),
      tokens_per_sample_(tokens_per_sample),
      device_(device),
      enabled_(enabled),
      out_(out) {}

void StepLogger::record(const StepRecord& r) {
  skipped_ += r.skipped ? 1 : 0;
  times_.push_back(r.seconds);
  pending_.push_back(r);
  last_loss_ = r.loss;
  if ((r.step + 1) % interval_ != 0 && r.step + 1 != total_) return;
  double loss = 0, seconds = 0;
  for (const auto& p : pending_) {
    loss += p.loss;
    seconds += p.seconds;
  }
  loss /= static_cast<double>(pending_.size());
  seconds /= static_cast<double>(pending_.size());
  pending_.clear();
  if (!enabled_) return;
  const int width = static_cast<int>(std::to_string(total_).size());
  std::fprintf(out_, " step %*lld/%lld | loss %.6E | lr %.6E | grad norm %.4f | %.1f ms/step", width,
               static_cast<long long>(r.step + 1), static_cast<long long>(total_), loss, r.lr, r.grad_norm,
               seconds * 1e3);
  if (tokens_per_sample_ > 0) {
    std::fprintf(out_, " | %.0f tokens/s", static_cast<double>(samples_ * tokens_per_sample_) / seconds);
  }
  std::fprintf(out_, " | %.1f samples/s | skipped %lld | peak mem %s\n", static_cast<double>(samples_) / seconds,
               static_cast<long long>(skipped_), peak_memory_text(device_).c_str());
  std::fflush(out_);
}

void StepLogger::summary() const {
  if (!enabled_ || times_.empty()) return;
  // Mean over the steps after the warm-up (all of them when the run is that short).
  const size_t first = times_.size() > static_cast<size_t>(kWarmupSteps) ? kWarmupSteps : 0;
  const double mean =
      std::accumulate(times_.begin() + first, times_.end(), 0.0) / static_cast<double>(times_.size() - first);
  std::fprintf(out_, "# summary: %zu steps, mean step time %.1f ms (steps %zu-%zu)", times_.size(), mean * 1e3,
               first + 1, times_.size());
  if (tokens_per_sample_ > 0) {
    std::fprintf(out_, ", %.0f tokens/s", static_cast<double>(samples_ * tokens_per_sample_) / mean);
  }
  std::fprintf(out_, ", %.1f samples/s, %lld skipped step(s), final loss %.6E, peak mem %s\n",
               static_cast<double>(samples_) / mean, static_cast<long long>(skipped_), last_loss_,
               peak_memory_text(device_).c_str());
  std::fflush(out_);
}

}  // namespace examples
