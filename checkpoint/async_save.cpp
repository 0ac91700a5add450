#include "checkpoint/async_save.h"

#include "checkpoint/file_check.h"
#include "checkpoint/save_phases.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <cstdio>
#include <functional>

namespace meshddp {
namespace {

double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

// One save in flight: its arguments (which save_phases::Save references), its snapshot, and the
// writer thread's job (phase 2 on every rank, then phase 3 on rank 0).
struct AsyncCheckpointSave::Pending {
  enum class Phase { kWriting, kCommitting };
  CheckpointMesh mesh;
  std::string dir;
  CheckpointMeta meta;
  CheckpointSaveOptions options;
  std::vector<CheckpointTensor> snapshot;
  std::unique_ptr<save_phases::Save> save;
  std::string save_id;
  Phase phase = Phase::kWriting;
  std::thread worker;
  std::atomic<bool> done{true};
  Json result = Json::object();  // the job's status; read after join()
  double write_ms = 0;
  int64_t file_bytes = 0;

  // Runs `job` on the writer thread; its exceptions become an error status.
  void run(std::function<Json()> job) {
    TORCH_INTERNAL_ASSERT(!worker.joinable(), "one writer job at a time");
    done.store(false);
    worker = std::thread([this, job = std::move(job)] {
      Json status;
      try {
        status = job();
      } catch (const std::exception& e) {
        status = Json{{"error", message_of(e)}};
      }
      result = std::move(status);
      done.store(true, std::memory_order_release);
    });
  }
  void join() {
    if (worker.joinable()) worker.join();
  }
  AsyncSaveReport report(AsyncSaveReport::Kind kind, std::string message = "") const {
    AsyncSaveReport r;
    r.kind = kind;
    r.step = meta.step;
    r.path = save->step_dir;
    r.message = std::move(message);
    r.write_ms = write_ms;
    r.file_bytes = file_bytes;
    return r;
  }
};

AsyncCheckpointSave::AsyncCheckpointSave(CheckpointMesh mesh) : mesh_(std::move(mesh)) {
  TORCH_CHECK(mesh_.world, "AsyncCheckpointSave: no world group");
}

AsyncCheckpointSave::~AsyncCheckpointSave() {
  if (!pending_) return;
  pending_->join();
  std::fprintf(stderr,
               "meshddp: warning: rank %lld: the checkpoint save of step %lld to '%s' was abandoned before its commit "
               "(it was still pending when its AsyncCheckpointSave was destroyed; wait() at the end of training "
               "commits it); %s\n",
               static_cast<long long>(mesh_.world->getRank()), static_cast<long long>(pending_->meta.step),
               pending_->save->step_dir.c_str(), save_phases::latest_after_failure(pending_->dir).c_str());
  std::fflush(stderr);
}

int64_t AsyncCheckpointSave::pending_step() const { return pending_ ? pending_->meta.step : -1; }

int64_t AsyncCheckpointSave::snapshot_bytes() const {
  int64_t bytes = 0;
  for (const at::Tensor& b : buffers_) bytes += static_cast<int64_t>(b.nbytes());
  return bytes;
}

AsyncSaveStart AsyncCheckpointSave::start(const std::string& dir, const CheckpointMeta& meta,
                                          const std::vector<CheckpointTensor>& tensors,
                                          const CheckpointSaveOptions& options) {
  AsyncSaveStart out;
  const auto t0 = std::chrono::steady_clock::now();
  const bool was_pending = pending();
  out.previous = settle_pending(meta.step, dir, options);
  if (was_pending && options.if_busy == CheckpointSaveOptions::IfBusy::kWait) out.wait_ms = ms_since(t0);
  try {
    return start_after_settling(dir, meta, tensors, options, out);
  } catch (const c10::Error& e) {
    // The save waited for failed too: both are reported, in order (the caller reports out.previous
    // only when this returns).
    if (!out.previous.failed()) throw;
    TORCH_CHECK(false, out.previous.message, "\nThen the next save failed too: ", e.what_without_backtrace());
  }
}

AsyncSaveReport AsyncCheckpointSave::settle_pending(int64_t step, const std::string& dir,
                                                    const CheckpointSaveOptions& options) {
  if (!pending_) return {};  // every rank has the same pending save, so all take one branch
  const bool refuse = options.if_busy == CheckpointSaveOptions::IfBusy::kRefuse;
  const std::vector<Json> ifs =
      save_phases::agree(*mesh_.world, Json{{"if_busy_refuse", refuse}}, "checkpoint save: if_busy");
  std::string values;
  bool same = true;
  for (size_t r = 0; r < ifs.size(); ++r) {
    const bool theirs = json_bool(json_at(ifs[r], "if_busy_refuse", "if_busy"), "if_busy_refuse");
    same = same && theirs == refuse;
    values += (r ? ", rank " : "rank ") + std::to_string(r) + (theirs ? " refuse" : " wait");
  }
  TORCH_CHECK(same, "checkpoint save of step ", step, " to '", dir, "/step-", step,
              "' refused on every rank: the ranks disagree on if_busy (save_checkpoint(..., if_busy=) in Python, ",
              "CheckpointSaveOptions::if_busy in C++): ", values, "; with the save of step ", pending_->meta.step,
              " still pending they would go separate ways. Pass the same value on every rank; the save of step ",
              pending_->meta.step, " goes on and is committed at a later step boundary");
  if (!refuse) return wait();
  AsyncSaveReport previous = advance(/*block=*/false);  // collective: it may have finished since the last poll
  TORCH_CHECK(!pending_, "checkpoint save of step ", step, " to '", dir, "/step-", step, "' refused: the save of step ",
              pending_->meta.step, " to '", pending_->save->step_dir,
              "' is still being written (one save at a time; options.if_busy is IfBusy::kRefuse). Save at a ",
              "later step, or pass IfBusy::kWait to wait for it");
  return previous;
}

AsyncSaveStart AsyncCheckpointSave::start_after_settling(const std::string& dir, const CheckpointMeta& meta,
                                                         const std::vector<CheckpointTensor>& tensors,
                                                         const CheckpointSaveOptions& options, AsyncSaveStart out) {
  // (1) The snapshot, into the buffers of the previous save when the pieces are the same.
  auto t0 = std::chrono::steady_clock::now();
  bool reuse = buffers_.size() == tensors.size();
  for (size_t i = 0; reuse && i < tensors.size(); ++i) {
    reuse = buffers_[i].numel() == tensors[i].data.numel() &&
            buffers_[i].scalar_type() == tensors[i].data.scalar_type() &&
            buffers_[i].is_pinned() == tensors[i].data.is_cuda();
  }
  if (!reuse) {
    buffers_.clear();
    for (const CheckpointTensor& t : tensors) {
      buffers_.push_back(
          at::empty({t.data.numel()}, at::TensorOptions().dtype(t.data.scalar_type()).pinned_memory(t.data.is_cuda())));
    }
  }
  auto pending = std::make_unique<Pending>();
  {
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i < tensors.size(); ++i) {
      buffers_[i].copy_(tensors[i].data.reshape({-1}));
      CheckpointTensor copy = tensors[i];
      copy.data = buffers_[i];
      pending->snapshot.push_back(std::move(copy));
    }
  }
  out.snapshot_ms = ms_since(t0);
  // (2) Phase 1, collective: throws on every rank, and nothing is pending.
  t0 = std::chrono::steady_clock::now();
  pending->mesh = mesh_;
  pending->dir = dir;
  pending->meta = meta;
  pending->options = options;
  pending->save = std::make_unique<save_phases::Save>(pending->mesh, pending->dir, pending->meta);
  pending->save_id = save_phases::prepare(*pending->save, /*async_save=*/true);
  out.prepare_ms = ms_since(t0);
  out.path = pending->save->step_dir;
  // (3) Phase 2 on the writer thread.
  Pending* p = pending.get();
  p->run([p] {
    const auto start = std::chrono::steady_clock::now();
    Json status = Json::object();
    save_phases::write_rank_file(*p->save, p->save_id, p->snapshot, p->options, status);
    p->write_ms = ms_since(start);
    p->file_bytes = json_int(json_at(json_at(status, "file", "status"), "bytes", "file"), "bytes");
    return status;
  });
  pending_ = std::move(pending);
  return out;
}

AsyncSaveReport AsyncCheckpointSave::poll() { return advance(/*block=*/false); }

AsyncSaveReport AsyncCheckpointSave::wait() {
  for (;;) {
    AsyncSaveReport r = advance(/*block=*/true);
    if (r.kind != AsyncSaveReport::Kind::kPending) return r;
  }
}

AsyncSaveReport AsyncCheckpointSave::advance(bool block) {
  if (!pending_) return {};
  Pending& p = *pending_;
  const save_phases::Save& s = *p.save;
  if (block) p.join();
  // Is every rank's writer done? (rank 0's commit result rides along: it is small)
  Json mine = {{"done", p.done.load(std::memory_order_acquire)}};
  if (p.phase == Pending::Phase::kCommitting && p.done.load(std::memory_order_acquire)) {
    p.join();
    mine["result"] = p.result;
  }
  const std::vector<Json> flags = save_phases::agree(*mesh_.world, mine, "checkpoint save: background progress");
  for (const Json& f : flags) {
    if (!json_bool(json_at(f, "done", "progress"), "done")) return p.report(AsyncSaveReport::Kind::kPending);
  }
  p.join();
  if (p.phase == Pending::Phase::kWriting) {
    // Every rank's file is written (or failed): the phase 2 agreement of the sync save.
    const std::vector<Json> statuses = save_phases::agree(*mesh_.world, p.result, "checkpoint save: files");
    const std::string errors = save_phases::errors_of(statuses);
    if (!errors.empty()) {
      AsyncSaveReport r = p.report(AsyncSaveReport::Kind::kFailed, s.failure("writing the files", errors));
      pending_.reset();
      return r;
    }
    p.phase = Pending::Phase::kCommitting;
    if (s.rank == 0) {
      p.run([&p, statuses] {
        Json status = Json::object();
        save_phases::commit_manifest(*p.save, save_phases::manifest_of(*p.save, p.save_id, statuses), p.options,
                                     status);
        return status;
      });
    } else {
      p.result = Json::object();
    }
    return block ? advance(block) : p.report(AsyncSaveReport::Kind::kPending);
  }
  // Phase 3 is done on rank 0: committed, or not.
  const Json& rank0 = json_at(flags[0], "result", "rank 0's progress");
  if (rank0.contains("error")) {
    AsyncSaveReport r =
        p.report(AsyncSaveReport::Kind::kFailed,
                 s.failure("writing the manifest", save_phases::errors_of(std::vector<Json>(1, rank0))));
    pending_.reset();
    return r;
  }
  note_live_checkpoint(p.dir, s.name);
  save_phases::warn_if_pruning_failed(s, rank0, p.options);
  AsyncSaveReport r = p.report(AsyncSaveReport::Kind::kCommitted);
  pending_.reset();
  return r;
}

}  // namespace meshddp
