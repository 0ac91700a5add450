// What both examples' training loops share besides flags and the log: the mesh options and the LR
// schedule the flags ask for, the --inject-nan gradient hook and the ZeRO-1 skipped-step policy
// (--max-skipped-steps). The plain-DDP gradient norm is the library's (common/grad_norm.h).
#pragma once

#include "examples/common/run_flags.h"

#include <ATen/core/Tensor.h>

#include <meshddp/meshddp.h>
#include <string>

namespace examples {

// timeout and stuck_report_after from --timeout-s and --stuck-report-s.
meshddp::MeshOptions mesh_options(const RunFlags& f);

// --lr, --min-lr, --warmup-steps, --lr-decay-style over --steps.
meshddp::LrScheduleConfig lr_schedule(const RunFlags& f);

// --inject-nan STEP:RANK: during STEP's backward on global rank RANK, element 0 of `param`'s
// gradient becomes NaN (a tensor hook, so before the gradient reaches the buffer and its bucket
// collective). A STEP outside [first_step, steps) or a RANK outside the world throws naming the flag
// (it would never fire: a test of the NaN path would pass without testing it).
class NanInjector {
 public:
  NanInjector(StepRank at, int64_t first_step, int64_t steps, int64_t world_size, at::Tensor param, std::string name);
  // Call before backward: arms the hook if this is the step and the rank.
  void before_backward(int64_t step, int64_t rank);
  // Call after backward: disarms it.
  void after_backward();

 private:
  StepRank at_;
  at::Tensor param_;
  std::string name_;
  int64_t hook_ = -1;
};

// Prints "<program> (rank R): <message>" to stderr in one write(2), so that the reports of ranks
// failing at the same moment (every rank throws the same error) do not interleave mid-line.
void report_error(const char* program, const std::string& message);

// ZeRO-1: prints each skipped step's report (rank 0) and throws, once `max_consecutive` steps in a
// row were skipped, an error that says so.
class SkippedSteps {
 public:
  explicit SkippedSteps(int64_t max_consecutive) : max_(max_consecutive) {}
  void on_step(int64_t step, const meshddp::StepResult& result, bool print);

 private:
  int64_t max_;
  int64_t consecutive_ = 0;
};

}  // namespace examples
