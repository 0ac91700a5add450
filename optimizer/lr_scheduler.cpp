#include "optimizer/lr_scheduler.h"

#include "optimizer/distributed_optimizer.h"

#include <c10/util/Exception.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <cstdio>

namespace meshddp {

void LrScheduleConfig::validate() const {
  TORCH_CHECK(max_lr > 0 && std::isfinite(max_lr), "LrScheduleConfig: max_lr must be > 0, got ", max_lr);
  TORCH_CHECK(min_lr >= 0 && min_lr <= max_lr, "LrScheduleConfig: min_lr must be in [0, max_lr = ", max_lr, "], got ",
              min_lr);
  TORCH_CHECK(init_lr >= 0 && init_lr <= max_lr, "LrScheduleConfig: init_lr must be in [0, max_lr = ", max_lr,
              "], got ", init_lr);
  TORCH_CHECK(warmup_steps >= 0, "LrScheduleConfig: warmup_steps must be >= 0, got ", warmup_steps);
  TORCH_CHECK(decay_style == LrDecayStyle::kConstant || decay_steps > warmup_steps, "LrScheduleConfig: decay_steps (",
              decay_steps, ") must be > warmup_steps (", warmup_steps, ") with decay style ", to_string(decay_style),
              "; decay_steps counts from step 0, warm-up included");
  TORCH_CHECK((start_wd < 0) == (end_wd < 0), "LrScheduleConfig: set both start_wd and end_wd (>= 0) to schedule ",
              "weight decay, or neither; got start_wd ", start_wd, ", end_wd ", end_wd);
  if (schedules_weight_decay()) {
    TORCH_CHECK(wd_incr_style != WdIncrStyle::kConstant || start_wd == end_wd, "LrScheduleConfig: wd_incr_style ",
                "constant needs start_wd == end_wd, got ", start_wd, " and ", end_wd);
    TORCH_CHECK(wd_incr_style == WdIncrStyle::kConstant || wd_incr_steps > 0, "LrScheduleConfig: wd_incr_steps must ",
                "be > 0 with wd_incr_style ", to_string(wd_incr_style), ", got ", wd_incr_steps);
  }
}

const char* to_string(LrDecayStyle style) {
  switch (style) {
    case LrDecayStyle::kConstant:
      return "constant";
    case LrDecayStyle::kLinear:
      return "linear";
    case LrDecayStyle::kCosine:
      return "cosine";
  }
  return "?";
}

const char* to_string(WdIncrStyle style) {
  switch (style) {
    case WdIncrStyle::kConstant:
      return "constant";
    case WdIncrStyle::kLinear:
      return "linear";
    case WdIncrStyle::kCosine:
      return "cosine";
  }
  return "?";
}

double lr_at(const LrScheduleConfig& c, int64_t n) {
  TORCH_CHECK(n >= 0, "lr_at: the step count must be >= 0, got ", n);
  if (c.warmup_steps > 0 && n <= c.warmup_steps) {
    return c.init_lr + (c.max_lr - c.init_lr) * static_cast<double>(n) / static_cast<double>(c.warmup_steps);
  }
  if (c.decay_style == LrDecayStyle::kConstant) return c.max_lr;
  if (n > c.decay_steps) return c.min_lr;
  const double ratio = static_cast<double>(n - c.warmup_steps) / static_cast<double>(c.decay_steps - c.warmup_steps);
  TORCH_INTERNAL_ASSERT(ratio >= 0.0 && ratio <= 1.0, "decay ratio ", ratio);
  const double coeff = c.decay_style == LrDecayStyle::kLinear ? 1.0 - ratio : 0.5 * (std::cos(M_PI * ratio) + 1.0);
  return c.min_lr + coeff * (c.max_lr - c.min_lr);
}

double weight_decay_at(const LrScheduleConfig& c, int64_t n) {
  TORCH_CHECK(c.schedules_weight_decay(), "weight_decay_at: the schedule has no start_wd / end_wd");
  if (n > c.wd_incr_steps || c.wd_incr_style == WdIncrStyle::kConstant) return c.end_wd;
  const double ratio = static_cast<double>(n) / static_cast<double>(c.wd_incr_steps);
  const double coeff = c.wd_incr_style == WdIncrStyle::kLinear ? ratio : 0.5 * (std::cos(M_PI * (1.0 - ratio)) + 1.0);
  return c.start_wd + coeff * (c.end_wd - c.start_wd);
}

LrScheduler::LrScheduler(LrScheduleConfig config) : config_(config) { config_.validate(); }

double LrScheduler::weight_decay() const { return weight_decay_at(config_, steps_); }

void LrScheduler::attach(DistributedOptimizer& optimizer) {
  targets_.push_back([&optimizer](double lr, const double* wd) {
    optimizer.set_lr(lr);
    if (wd) optimizer.set_weight_decay(*wd);
  });
  apply();
}

namespace {

// The weight-decay field of a torch::optim group's options, or null for an optimizer without one.
double* weight_decay_field(torch::optim::OptimizerOptions& options) {
  if (auto* o = dynamic_cast<torch::optim::AdamWOptions*>(&options)) return &o->weight_decay();
  if (auto* o = dynamic_cast<torch::optim::AdamOptions*>(&options)) return &o->weight_decay();
  if (auto* o = dynamic_cast<torch::optim::SGDOptions*>(&options)) return &o->weight_decay();
  if (auto* o = dynamic_cast<torch::optim::RMSpropOptions*>(&options)) return &o->weight_decay();
  if (auto* o = dynamic_cast<torch::optim::AdagradOptions*>(&options)) return &o->weight_decay();
  return nullptr;
}

}  // namespace

void LrScheduler::attach(torch::optim::Optimizer& optimizer) {
  // Ratios to the defaults, taken now: the groups' values change with the schedule, the ratios don't.
  const double base_lr = optimizer.defaults().get_lr();
  TORCH_CHECK(base_lr > 0, "LrScheduler::attach: the optimizer's default lr is ", base_lr,
              "; give it the schedule's max_lr so each group's ratio to it is defined");
  double* base_wd_field = weight_decay_field(optimizer.defaults());
  TORCH_CHECK(!config_.schedules_weight_decay() || base_wd_field, "LrScheduler::attach: this torch::optim optimizer ",
              "has no weight_decay option the scheduler knows (AdamW, Adam, SGD, RMSprop, Adagrad)");
  const double base_wd = base_wd_field ? *base_wd_field : 0.0;
  std::vector<double> lr_ratio, wd_ratio;
  for (auto& group : optimizer.param_groups()) {
    lr_ratio.push_back(group.options().get_lr() / base_lr);
    double* wd = weight_decay_field(group.options());
    // A group whose decay differs from a zero default keeps its own value (ratio undefined): NaN marks it.
    wd_ratio.push_back(!wd ? 0.0 : base_wd > 0 ? *wd / base_wd : (*wd == 0 ? 0.0 : std::nan("")));
  }
  targets_.push_back([&optimizer, lr_ratio, wd_ratio](double lr, const double* wd) {
    auto& groups = optimizer.param_groups();
    TORCH_CHECK(groups.size() == lr_ratio.size(), "LrScheduler: the optimizer had ", lr_ratio.size(),
                " param groups when attached and has ", groups.size(), " now; attach after adding every group");
    for (size_t g = 0; g < groups.size(); ++g) {
      groups[g].options().set_lr(lr * lr_ratio[g]);
      if (wd && !std::isnan(wd_ratio[g])) {
        if (double* field = weight_decay_field(groups[g].options())) *field = *wd * wd_ratio[g];
      }
    }
    optimizer.defaults().set_lr(lr);
    if (wd) {
      if (double* field = weight_decay_field(optimizer.defaults())) *field = *wd;
    }
  });
  apply();
}

void LrScheduler::apply() const {
  const double lr_now = lr();
  const double wd_now = config_.schedules_weight_decay() ? weight_decay() : 0.0;
  for (const auto& target : targets_) target(lr_now, config_.schedules_weight_decay() ? &wd_now : nullptr);
}

void LrScheduler::step(int64_t increment) {
  TORCH_CHECK(increment >= 0, "LrScheduler::step: increment must be >= 0, got ", increment);
  steps_ += increment;
  apply();
}

namespace {

std::string exact(double v) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.17g", v);
  return text;
}

}  // namespace

SchedulerState LrScheduler::state() const {
  const LrScheduleConfig& c = config_;
  return {{"lr_scheduler.steps", std::to_string(steps_)},
          {"lr_scheduler.max_lr", exact(c.max_lr)},
          {"lr_scheduler.min_lr", exact(c.min_lr)},
          {"lr_scheduler.init_lr", exact(c.init_lr)},
          {"lr_scheduler.warmup_steps", std::to_string(c.warmup_steps)},
          {"lr_scheduler.decay_steps", std::to_string(c.decay_steps)},
          {"lr_scheduler.decay_style", to_string(c.decay_style)},
          {"lr_scheduler.start_wd", exact(c.start_wd)},
          {"lr_scheduler.end_wd", exact(c.end_wd)},
          {"lr_scheduler.wd_incr_steps", std::to_string(c.wd_incr_steps)},
          {"lr_scheduler.wd_incr_style", to_string(c.wd_incr_style)}};
}

void LrScheduler::load_state(const SchedulerState& state, bool use_checkpoint_config) {
  const SchedulerState mine = this->state();
  for (const auto& [key, value] : mine) {
    TORCH_CHECK(state.count(key), "LrScheduler::load_state: the saved state has no '", key,
                "' (not a scheduler state, or from another version)");
  }
  LrScheduleConfig loaded;
  auto number = [&](const char* key) {
    const std::string& text = state.at(std::string("lr_scheduler.") + key);
    char* end = nullptr;
    const double v = std::strtod(text.c_str(), &end);
    TORCH_CHECK(!text.empty() && *end == '\0', "LrScheduler::load_state: '", key, "' = '", text, "' is not a number");
    return v;
  };
  auto decay_style = [&](const std::string& text) {
    for (auto s : {LrDecayStyle::kConstant, LrDecayStyle::kLinear, LrDecayStyle::kCosine}) {
      if (text == to_string(s)) return s;
    }
    TORCH_CHECK(false, "LrScheduler::load_state: unknown decay_style '", text, "'");
  };
  auto wd_style = [&](const std::string& text) {
    for (auto s : {WdIncrStyle::kConstant, WdIncrStyle::kLinear, WdIncrStyle::kCosine}) {
      if (text == to_string(s)) return s;
    }
    TORCH_CHECK(false, "LrScheduler::load_state: unknown wd_incr_style '", text, "'");
  };
  loaded.max_lr = number("max_lr");
  loaded.min_lr = number("min_lr");
  loaded.init_lr = number("init_lr");
  loaded.warmup_steps = static_cast<int64_t>(number("warmup_steps"));
  loaded.decay_steps = static_cast<int64_t>(number("decay_steps"));
  loaded.decay_style = decay_style(state.at("lr_scheduler.decay_style"));
  loaded.start_wd = number("start_wd");
  loaded.end_wd = number("end_wd");
  loaded.wd_incr_steps = static_cast<int64_t>(number("wd_incr_steps"));
  loaded.wd_incr_style = wd_style(state.at("lr_scheduler.wd_incr_style"));
  const auto steps = static_cast<int64_t>(number("steps"));
  TORCH_CHECK(steps >= 0, "LrScheduler::load_state: steps = ", steps);
  if (use_checkpoint_config) {
    loaded.validate();
    config_ = loaded;
  } else {
    for (const auto& [key, value] : mine) {
      if (key == "lr_scheduler.steps") continue;
      TORCH_CHECK(state.at(key) == value, "LrScheduler::load_state: '", key, "' is ", state.at(key),
                  " in the checkpoint but ", value, " in this run; use the same schedule, or load with ",
                  "use_checkpoint_config = true to take the checkpoint's");
    }
  }
  steps_ = steps;
  apply();
}

}  // namespace meshddp
