// The flags every example shares (steps, logging, learning-rate schedule, failure handling), parsed
// with the strict helpers of flags.h. Each example keeps its own model and data flags and hands the
// rest to parse_run_flag().
#pragma once

#include "examples/common/flags.h"

#include <string>

namespace examples {

struct RunFlags {
  int64_t steps = 30;                       // optimizer steps, >= 1
  double lr = 1e-2;                         // peak learning rate, > 0
  double min_lr = 0.0;                      // the schedule decays to this, >= 0 and <= lr
  int64_t warmup_steps = 0;                 // linear warm-up from 0 to lr over this many steps
  std::string lr_decay_style = "constant";  // constant | linear | cosine, over --steps
  int64_t log_interval = 1;                 // human log line every N steps (and at the last one)
  std::string log_file;                     // `step <n> loss <x>` lines go here instead of stdout
  StepRank inject_nan;                      // make one gradient element NaN on RANK at STEP (testing)
  int64_t max_skipped_steps = 3;            // ZeRO-1: stop after this many consecutive skipped steps
  double timeout_s = 600;                   // a collective (or rendezvous) that waits longer fails
  double stuck_report_s = 30;  // a rank waiting longer than this on a collective names the missing ranks; 0 = off
};

// The usage text of the shared flags.
inline const char* run_flags_usage() {
  return "[--steps N] [--lr X] [--min-lr X] [--warmup-steps N] [--lr-decay-style constant|linear|cosine] "
         "[--log-interval N] [--log-file PATH] [--inject-nan STEP:RANK] [--max-skipped-steps N] [--timeout-s X] "
         "[--stuck-report-s X]";
}

// Parses `arg value` into `f` if `arg` is a shared flag; false if it is not one. Throws FlagError.
inline bool parse_run_flag(const std::string& arg, const std::string& v, RunFlags& f) {
  if (arg == "--steps")
    f.steps = parse_int_flag(arg, v, 1);
  else if (arg == "--lr")
    f.lr = parse_float_flag(arg, v, 0.0, false);
  else if (arg == "--min-lr")
    f.min_lr = parse_float_flag(arg, v, 0.0, true);
  else if (arg == "--warmup-steps")
    f.warmup_steps = parse_int_flag(arg, v, 0);
  else if (arg == "--lr-decay-style")
    f.lr_decay_style = parse_choice_flag(arg, v, {"constant", "linear", "cosine"});
  else if (arg == "--log-interval")
    f.log_interval = parse_int_flag(arg, v, 1);
  else if (arg == "--log-file")
    f.log_file = v;
  else if (arg == "--inject-nan")
    f.inject_nan = parse_step_rank_flag(arg, v);
  else if (arg == "--max-skipped-steps")
    f.max_skipped_steps = parse_int_flag(arg, v, 1);
  else if (arg == "--timeout-s")
    f.timeout_s = parse_float_flag(arg, v, 0.0, false);
  else if (arg == "--stuck-report-s")
    f.stuck_report_s = parse_float_flag(arg, v, 0.0, true);
  else
    return false;
  return true;
}

// Cross-flag checks; throws FlagError naming both flags.
inline void validate_run_flags(const RunFlags& f) {
  if (f.min_lr > f.lr)
    throw FlagError("--min-lr " + std::to_string(f.min_lr) + " must be <= --lr " + std::to_string(f.lr));
  if (f.warmup_steps >= f.steps && f.lr_decay_style != "constant") {
    throw FlagError("--warmup-steps " + std::to_string(f.warmup_steps) + " must be < --steps " +
                    std::to_string(f.steps) + " with --lr-decay-style " + f.lr_decay_style);
  }
}

}  // namespace examples
