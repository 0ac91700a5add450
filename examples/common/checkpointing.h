// The examples' checkpoint flags: --save-dir DIR, --save-every N, --keep-last K, --resume,
// --resume-step N. Header-only, so each example keeps its own main.cpp and calls three things:
// parse_checkpoint_flag() in its flag loop, ExampleCheckpoints::resume() for the first step,
// after_step() at the end of each step.
//
//   --save-dir DIR     where checkpoints go: DIR/step-<N>/ (N = steps completed), DIR/latest
//   --save-every N     save every N steps (and always after the last step); 0 = only after the last
//   --keep-last K      after each save keep the K newest checkpoints of this run (the one it resumed
//                      from and those saved since), delete the rest; 0 = keep all
//   --resume           start from DIR's latest checkpoint (at any --dp/--tp), continue up to --steps;
//                      with no checkpoint in DIR (missing, or no complete step), start from step 0 and
//                      say so. Checkpoints that exist but cannot be loaded stop the run (exit 1).
//   --resume-step N    start from DIR/step-<N> (a rollback: later saves continue from it, and
//                      --keep-last counts from it, not the abandoned newer steps); implies --resume
//   --async-save       save asynchronously (meshddp::CheckpointSaver): a host snapshot at the step
//                      boundary, the write in the background, the commit at a later step boundary;
//                      the step log says when each save started, what it stalled, and when it
//                      committed. The last step's save is waited for (committed) before the run ends;
//                      a run that stops on an error says the pending save was abandoned.
// The data position (the next step; batches are a function of (seed, step)), the seed and the
// global batch are saved as user values; resuming with another seed or global batch is refused.
#pragma once

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <meshddp/meshddp.h>
#include <optional>
#include <string>
#include <utility>
#include <variant>

namespace examples {

struct CheckpointFlags {
  std::string save_dir;
  int save_every = 0;
  int keep_last = 0;
  bool resume = false;
  bool async_save = false;
  std::optional<int64_t> resume_step;
  bool any() const { return !save_dir.empty(); }
};

// Consumes argv[i] (and its value) if it is a checkpoint flag; returns false otherwise. A bad value
// exits with status 2, like the examples' other flags.
inline bool parse_checkpoint_flag(int argc, char** argv, int& i, CheckpointFlags& f) {
  const std::string arg = argv[i];
  if (arg == "--resume") {
    f.resume = true;
    return true;
  }
  if (arg == "--async-save") {
    f.async_save = true;
    return true;
  }
  if (arg != "--save-dir" && arg != "--save-every" && arg != "--keep-last" && arg != "--resume-step") return false;
  const auto fail = [&](const std::string& why) {
    std::fprintf(stderr, "error: %s %s\n", arg.c_str(), why.c_str());
    std::exit(2);
  };
  if (i + 1 >= argc) fail("needs a value");
  const std::string v = argv[++i];
  if (arg == "--save-dir") {
    f.save_dir = v;
    return true;
  }
  char* end = nullptr;
  const long n = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || n < 0 || n > INT32_MAX) fail("needs a count >= 0, got '" + v + "'");
  if (arg == "--resume-step") {
    f.resume = true;
    f.resume_step = n;
  } else {
    (arg == "--keep-last" ? f.keep_last : f.save_every) = static_cast<int>(n);
  }
  return true;
}
inline const char* checkpoint_usage() {
  return " [--save-dir DIR [--save-every N] [--keep-last K] [--async-save] [--resume | --resume-step N]]";
}

class ExampleCheckpoints {
 public:
  // `state`: a meshddp::TrainingState, or a PipelineTrainingState (a pipeline rank's chunks).
  ExampleCheckpoints(CheckpointFlags flags, std::variant<meshddp::TrainingState, meshddp::PipelineTrainingState> state,
                     int64_t rank, uint64_t seed, int64_t global_batch)
      : f_(std::move(flags)),
        state_(state),
        rank_(rank),
        seed_(static_cast<int64_t>(seed)),
        global_batch_(global_batch),
        saver_(std::visit([](const auto& s) { return meshddp::CheckpointSaver(s); }, state)) {
    TORCH_CHECK(!f_.resume || f_.any(), "--resume needs --save-dir");
    TORCH_CHECK(!f_.async_save || f_.any(), "--async-save needs --save-dir");
  }

  // Saves `schedule`'s state with every checkpoint (as "lr_schedule/<key>" values) and restores its
  // step count on resume, so the LR continues where it was (skipped steps included); the schedule's
  // settings are this run's.
  void track(meshddp::LrScheduler& schedule) { schedule_ = &schedule; }

  // What a failed resume adds to the load's error: which checkpoints this run's flags can resume and
  // the flags that resume the others (the load names the tensors that differ, not the flags that
  // shaped them: a pipeline trainer's separate lm_head.weight, bf16 params).
  void explain_load_failures(std::string hint) { load_hint_ = std::move(hint); }

  // The first step to run: 0, or the step after the checkpoint loaded.
  int resume() {
    if (!f_.resume) return 0;
    const auto start = std::chrono::steady_clock::now();
    std::optional<meshddp::LoadedCheckpoint> found;
    try {
      found =
          std::visit([&](const auto& s) { return meshddp::resume_checkpoint(s, f_.save_dir, f_.resume_step); }, state_);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, f_.resume_step ? "--resume-step " + std::to_string(*f_.resume_step) : std::string("--resume"),
                  ": ", e.what_without_backtrace(), load_hint_.empty() ? "" : "\n" + load_hint_,
                  f_.resume_step ? "" : "\nTo resume from a given complete step, pass --resume-step N");
    }
    if (!found) {
      if (rank_ == 0) {
        std::fprintf(stderr, "# --resume: no checkpoint in '%s' (missing, or no complete step): starting at step 0\n",
                     f_.save_dir.c_str());
      }
      return 0;
    }
    const meshddp::LoadedCheckpoint& loaded = *found;
    const auto value = [&](const char* key) { return int_value(loaded, key); };
    TORCH_CHECK(value("seed") == seed_ && value("global_batch") == global_batch_, "checkpoint '", loaded.path,
                "' was trained with --seed ", value("seed"), " --global-batch ", value("global_batch"),
                "; this run has --seed ", seed_, " --global-batch ", global_batch_,
                ": pass the same ones to continue the same run");
    if (schedule_ != nullptr) {
      meshddp::SchedulerState saved;
      for (const auto& [key, v] : loaded.values) {
        if (key.rfind(kSchedulePrefix, 0) == 0) {
          TORCH_CHECK(std::holds_alternative<std::string>(v), "checkpoint '", loaded.path, "': value '", key, "' is ",
                      type_name(v), "; expected a string (the LR schedule's state)");
          saved[key.substr(kSchedulePrefix.size())] = std::get<std::string>(v);
        }
      }
      // The step count carries over; the schedule itself comes from this run's flags (their
      // defaults depend on --steps, which a resumed run may extend), as Megatron's
      // --override-opt_param-scheduler does.
      const auto it = saved.find("lr_scheduler.steps");
      TORCH_CHECK(it != saved.end(), "checkpoint '", loaded.path, "' holds no LR schedule state");
      char* end = nullptr;
      errno = 0;
      const long long steps = std::strtoll(it->second.c_str(), &end, 10);
      TORCH_CHECK(!it->second.empty() && *end == '\0' && errno == 0 && steps >= 0, "checkpoint '", loaded.path,
                  "': value '", kSchedulePrefix, "lr_scheduler.steps' is '", it->second,
                  "'; expected a step count (an integer >= 0)");
      schedule_->step(steps - schedule_->steps());
    }
    if (rank_ == 0) {
      std::fprintf(stderr, "# resumed from '%s' (step %lld) in %.0f ms\n", loaded.path.c_str(),
                   static_cast<long long>(loaded.step), ms_since(start));
    }
    const int64_t position = value("data_position");
    TORCH_CHECK(position == loaded.step && position <= INT32_MAX, "checkpoint '", loaded.path, "' has data_position ",
                position, " but step ", loaded.step, "; this example saves them equal");
    return static_cast<int>(position);
  }

  // Call after step `step` (0-based) has finished, on every rank: reports a background save's commit
  // (or stops the run on its failure), then saves when due. The last step's save is committed before
  // this returns.
  void after_step(int step, int steps) {
    const int done = step + 1;
    if (!f_.any()) return;
    report(saver_.step_boundary(), done);
    if (!(done == steps || (f_.save_every > 0 && done % f_.save_every == 0))) return;
    meshddp::CheckpointValues values{
        {"data_position", int64_t{done}}, {"seed", seed_}, {"global_batch", global_batch_}};
    if (schedule_ != nullptr) {
      for (const auto& [key, v] : schedule_->state()) values[kSchedulePrefix + key] = v;
    }
    meshddp::CheckpointSaveOptions options;
    options.keep_last = f_.keep_last;
    options.async_save = f_.async_save;
    const meshddp::AsyncSaveStart started = saver_.save(f_.save_dir, done, values, options);
    report(started.previous, done);
    if (!f_.async_save) {
      if (rank_ == 0) {
        std::fprintf(stderr, "# saved '%s' (%lld bytes) in %.0f ms\n", started.path.c_str(),
                     static_cast<long long>(bytes_in(started.path)), started.sync_ms);
      }
      return;
    }
    if (rank_ == 0) {
      std::fprintf(stderr,
                   "# save of step %d started after step %d: stalled %.1f ms (waited %.1f ms for the previous save, "
                   "snapshot %.1f ms of %lld bytes, prepare %.1f ms); writing '%s' in the background\n",
                   done, step, started.stall_ms(), started.wait_ms, started.snapshot_ms,
                   static_cast<long long>(saver_.snapshot_bytes()), started.prepare_ms, started.path.c_str());
    }
    if (done == steps) report(saver_.wait(), done);  // the end of training: committed before the run ends
  }

 private:
  static const char* type_name(const meshddp::CheckpointValue& v) {
    return std::holds_alternative<int64_t>(v)  ? "an integer"
           : std::holds_alternative<double>(v) ? "a number"
                                               : "a string";
  }
  // The saved value `key`, which this example saved as an integer.
  static int64_t int_value(const meshddp::LoadedCheckpoint& loaded, const std::string& key) {
    auto it = loaded.values.find(key);
    TORCH_CHECK(it != loaded.values.end(), "checkpoint '", loaded.path, "' has no value '", key, "'");
    TORCH_CHECK(std::holds_alternative<int64_t>(it->second), "checkpoint '", loaded.path, "': value '", key, "' is ",
                type_name(it->second), "; expected an integer (saved by another program?)");
    return std::get<int64_t>(it->second);
  }
  // The step log's line for a background save that finished (failures throw in the saver).
  void report(const meshddp::AsyncSaveReport& r, int done) const {
    if (rank_ != 0 || r.kind != meshddp::AsyncSaveReport::Kind::kCommitted) return;
    std::fprintf(stderr,
                 "# save of step %lld committed at the boundary after step %d: '%s' (%lld bytes; rank 0 wrote its "
                 "%lld bytes in %.1f ms in the background)\n",
                 static_cast<long long>(r.step), done - 1, r.path.c_str(), static_cast<long long>(bytes_in(r.path)),
                 static_cast<long long>(r.file_bytes), r.write_ms);
  }
  static int64_t bytes_in(const std::string& path) {
    int64_t bytes = 0;
    for (const auto& entry : std::filesystem::directory_iterator(path)) {
      if (entry.is_regular_file()) bytes += static_cast<int64_t>(entry.file_size());
    }
    return bytes;
  }
  static double ms_since(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
  }
  inline static const std::string kSchedulePrefix = "lr_schedule/";
  CheckpointFlags f_;
  std::variant<meshddp::TrainingState, meshddp::PipelineTrainingState> state_;
  meshddp::LrScheduler* schedule_ = nullptr;
  std::string load_hint_;
  int64_t rank_;
  int64_t seed_, global_batch_;
  meshddp::CheckpointSaver saver_;  // last: its destructor names a save still pending as abandoned
};

}  // namespace examples
