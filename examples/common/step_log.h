// The examples' human step log (stderr, rank 0), in the spirit of Megatron's: one line per step or
// every --log-interval steps, and an end-of-run summary. The machine-readable `step <n> loss <x>`
// lines are the examples' own (stdout or --log-file), untouched by this.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace examples {

struct StepRecord {
  int64_t step = 0;      // 0-based
  double loss = 0;       // global-batch mean
  double lr = 0;         // the LR this step used
  double grad_norm = 0;  // global L2 norm before clipping (NaN when unknown or non-finite)
  double seconds = 0;    // wall time of the step
  bool skipped = false;  // the optimizer skipped it (non-finite gradients)
};

// "123.4 MiB RSS" (peak resident set of this process) on CPU, "56.7 MiB CUDA peak allocated" on GPU.
std::string peak_memory_text(c10::Device device);

class StepLogger {
 public:
  // samples_per_step: the global batch; tokens_per_sample: sequence length (0: no tokens/s column).
  // `enabled`: rank 0 logs, the others only count.
  StepLogger(int64_t total_steps, int64_t log_interval, int64_t samples_per_step, int64_t tokens_per_sample,
             c10::Device device, bool enabled, std::FILE* out = stderr);

  // Prints a line when step + 1 is a multiple of the interval, or the last step: loss and time
  // averaged over the steps since the last line, LR, grad norm of the last step.
  void record(const StepRecord& r);
  // "# summary: ..." (mean step time after the warm-up steps, throughput, skipped steps, peak memory).
  void summary() const;
  int64_t skipped() const { return skipped_; }

  // Steps left out of the summary's mean step time (first-step allocation, thread start-up).
  static constexpr int64_t kWarmupSteps = 3;

 private:
  int64_t total_, interval_, samples_, tokens_per_sample_;
  c10::Device device_;
  bool enabled_;
  std::FILE* out_;
  int64_t skipped_ = 0;
  std::vector<StepRecord> pending_;  // since the last line
  std::vector<double> times_;        // every step's seconds
  double last_loss_ = 0;
};

}  // namespace examples
