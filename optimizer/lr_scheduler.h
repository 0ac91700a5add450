// LrScheduler: the learning-rate (and weight-decay) schedule of Megatron-core's
// OptimizerParamScheduler -- linear warm-up, then constant, linear or cosine decay to a minimum LR,
// optionally a weight decay that rises from a start to an end value -- as pure functions of the step
// count (lr_at, weight_decay_at) plus a thin class that applies them to a DistributedOptimizer or to
// any torch::optim optimizer, and whose state saves and restores as key-values. No communication:
// every rank computes the same values from the same step count.
//
// Note [Schedule semantics, as Megatron]
//   n = steps taken so far (step() after each successful optimizer step; a skipped step does not count).
//   warm-up   n <= warmup_steps (and warmup_steps > 0): init_lr + (max_lr - init_lr) * n / warmup_steps
//   constant  max_lr after warm-up
//   after     n > decay_steps: min_lr
//   decay     r = (n - warmup_steps) / (decay_steps - warmup_steps) in [0, 1];
//             linear: coeff = 1 - r; cosine: coeff = (cos(pi r) + 1) / 2; lr = min_lr + coeff (max_lr - min_lr)
//   weight decay: n > wd_incr_steps: end_wd; constant: end_wd (== start_wd); else r = n / wd_incr_steps,
//             linear: coeff = r; cosine: coeff = (cos(pi (1 - r)) + 1) / 2; wd = start_wd + coeff (end_wd - start_wd)
// decay_steps counts from step 0 (warm-up included), as Megatron's lr_decay_steps.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace meshddp {

class DistributedOptimizer;

enum class LrDecayStyle { kConstant, kLinear, kCosine };
enum class WdIncrStyle { kConstant, kLinear, kCosine };

struct LrScheduleConfig {
  double max_lr = 1e-3;      // > 0: the LR after warm-up (the optimizer groups' base LR)
  double min_lr = 0.0;       // in [0, max_lr]: the LR after decay_steps
  double init_lr = 0.0;      // in [0, max_lr]: the LR at step 0 of the warm-up
  int64_t warmup_steps = 0;  // >= 0; 0 = no warm-up
  int64_t decay_steps = 0;   // > warmup_steps unless constant: the step where the decay reaches min_lr
  LrDecayStyle decay_style = LrDecayStyle::kConstant;
  // Weight decay increments (Megatron's start/end_weight_decay). Unset (negative) start_wd and
  // end_wd: the scheduler leaves weight decay alone.
  double start_wd = -1.0;     // >= 0 to schedule weight decay
  double end_wd = -1.0;       // >= 0 to schedule weight decay
  int64_t wd_incr_steps = 0;  // > 0 unless constant
  WdIncrStyle wd_incr_style = WdIncrStyle::kConstant;

  bool schedules_weight_decay() const { return start_wd >= 0 && end_wd >= 0; }
  void validate() const;  // throws naming the field
};

// The LR after `steps` optimizer steps (Note [Schedule semantics, as Megatron]). Pure.
double lr_at(const LrScheduleConfig& config, int64_t steps);
// The weight decay after `steps` steps; requires config.schedules_weight_decay(). Pure.
double weight_decay_at(const LrScheduleConfig& config, int64_t steps);

const char* to_string(LrDecayStyle style);
const char* to_string(WdIncrStyle style);

// The scheduler's state as text key-values (every field of the config, and the step count), for a
// checkpoint's user key-value map. Exact: doubles are written with 17 significant digits.
using SchedulerState = std::map<std::string, std::string>;

class LrScheduler {
 public:
  explicit LrScheduler(LrScheduleConfig config);

  // Drive `optimizer` (which must outlive this scheduler): sets its LR (and weight decay) for the
  // current step now and after every step(). DistributedOptimizer: through set_lr / set_weight_decay
  // (each param group keeps its ratio to the base). torch::optim: each param group keeps the ratio
  // of its LR (weight decay) to the optimizer's defaults as they are when attached.
  void attach(DistributedOptimizer& optimizer);
  void attach(torch::optim::Optimizer& optimizer);

  // Call after each successful optimizer step (Megatron does not count skipped steps).
  void step(int64_t increment = 1);

  int64_t steps() const { return steps_; }
  double lr() const { return lr_at(config_, steps_); }  // the LR the next optimizer step uses
  double weight_decay() const;                          // likewise; requires schedules_weight_decay()
  const LrScheduleConfig& config() const { return config_; }

  // Save / restore. `load_state` restores the step count and applies it; every config field in
  // `state` must equal this scheduler's (else it throws naming the field, checkpoint vs current
  // value), unless `use_checkpoint_config` (then the checkpoint's config replaces this one).
  SchedulerState state() const;
  void load_state(const SchedulerState& state, bool use_checkpoint_config = false);

 private:
  void apply() const;

  LrScheduleConfig config_;
  int64_t steps_ = 0;
  std::vector<std::function<void(double lr, const double* wd)>> targets_;
};

}  // namespace meshddp
