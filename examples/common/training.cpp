#include "examples/common/training.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <unistd.h>

namespace examples {

meshddp::MeshOptions mesh_options(const RunFlags& f) {
  meshddp::MeshOptions options;
  options.timeout = std::chrono::milliseconds(static_cast<int64_t>(std::llround(f.timeout_s * 1000)));
  options.stuck_report_after = std::chrono::milliseconds(static_cast<int64_t>(std::llround(f.stuck_report_s * 1000)));
  return options;
}

meshddp::LrScheduleConfig lr_schedule(const RunFlags& f) {
  meshddp::LrScheduleConfig c;
  c.max_lr = f.lr;
  c.min_lr = f.min_lr;
  c.init_lr = 0.0;
  c.warmup_steps = f.warmup_steps;
  c.decay_steps = f.steps;
  c.decay_style = f.lr_decay_style == "linear"   ? meshddp::LrDecayStyle::kLinear
                  : f.lr_decay_style == "cosine" ? meshddp::LrDecayStyle::kCosine
                                                 : meshddp::LrDecayStyle::kConstant;
  return c;
}

NanInjector::NanInjector(StepRank at, int64_t first_step, int64_t steps, int64_t world_size, at::Tensor param,
                         std::string name)
    : at_(at), param_(std::move(param)), name_(std::move(name)) {
  if (at_.step < 0 && at_.rank < 0) return;  // unset
  const std::string flag = "--inject-nan " + std::to_string(at_.step) + ":" + std::to_string(at_.rank);
  TORCH_CHECK(at_.rank >= 0 && at_.rank < world_size, flag, ": rank ", at_.rank, " is not a rank of this run (world ",
              "size ", world_size, "); give a rank in [0, ", world_size, ")");
  TORCH_CHECK(at_.step >= first_step && at_.step < steps, flag, ": step ", at_.step, " is not one this run takes ",
              "(steps ", first_step, " to ", steps - 1, "); give a step in that range");
}

void NanInjector::before_backward(int64_t step, int64_t rank) {
  if (step != at_.step || rank != at_.rank) return;
  std::fprintf(stderr, "# --inject-nan: rank %lld makes element 0 of the gradient of '%s' NaN at step %lld\n",
               static_cast<long long>(rank), name_.c_str(), static_cast<long long>(step));
  hook_ = static_cast<int64_t>(param_.register_hook([](const at::Tensor& grad) {
    at::Tensor out = grad.clone();
    out.view(-1)[0] = std::numeric_limits<double>::quiet_NaN();
    return out;
  }));
}

void NanInjector::after_backward() {
  if (hook_ < 0) return;
  param_.remove_hook(static_cast<unsigned>(hook_));
  hook_ = -1;
}

void SkippedSteps::on_step(int64_t step, const meshddp::StepResult& result, bool print) {
  if (!result.skipped) {
    consecutive_ = 0;
    return;
  }
  ++consecutive_;
  if (print) {
    std::fprintf(stderr, "step %lld skipped (%lld in a row, --max-skipped-steps %lld): %s\n",
                 static_cast<long long>(step), static_cast<long long>(consecutive_), static_cast<long long>(max_),
                 result.report.c_str());
    std::fflush(stderr);
  }
  TORCH_CHECK(consecutive_ < max_, "stopping: ", consecutive_, " consecutive steps skipped for non-finite gradients ",
              "(--max-skipped-steps ", max_, "), the last at step ", step, ". Last report:\n", result.report);
}

void report_error(const char* program, const std::string& message) {
  const char* rank = std::getenv("RANK");
  std::string line = std::string(program) + " (rank " + (rank ? rank : "?") + "): " + message;
  if (line.empty() || line.back() != '\n') line += '\n';
  size_t written = 0;
  while (written < line.size()) {  // one write(2) for messages under PIPE_BUF; loop only for longer ones
    const ssize_t n = ::write(STDERR_FILENO, line.data() + written, line.size() - written);
    if (n <= 0) break;
    written += static_cast<size_t>(n);
  }
}

}  // namespace examples
