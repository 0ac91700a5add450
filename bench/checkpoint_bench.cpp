// What a checkpoint save costs a training loop: the benchmark GPT (bench_models.h) under
// DistributedDataParallel + torch AdamW on torchrun's ranks (DP = world size), saving every
// --save-every steps through meshddp::CheckpointSaver, once synchronously and once asynchronously.
// Prints, per mode, the stall of each save (the time the save call kept the training loop: median
// and max over the saves), the median step time without a save, and for async saves the step time
// while a background write is in flight and the writer's throughput (rank 0's file bytes over its
// write, fsync, read-back and CRC time) against a plain write + fsync of the same bytes in the same
// directory (the disk's own). Not a test: numbers for docs/benchmarks.md.
//
//   torchrun --standalone --nproc-per-node 2 --no-python build/bench/checkpoint_bench --dir /tmp/ckpt-bench
//     [--layers 4 --hidden 256 --heads 4 --seq 128 --vocab 4096 --batch 2 --steps 40 --save-every 5]
#include "bench/bench_models.h"
#include "grad_buffer/grad_buffer.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fcntl.h>
#include <meshddp/meshddp.h>
#include <string>
#include <sys/stat.h>
#include <unistd.h>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
double max_of(const std::vector<double>& v) { return v.empty() ? 0 : *std::max_element(v.begin(), v.end()); }

// Writes `bytes` bytes to `path` and fsyncs it: the disk's own speed for a file of a save's size.
double plain_write_ms(const std::string& path, int64_t bytes) {
  std::vector<char> data(static_cast<size_t>(bytes), 'x');
  const auto t0 = Clock::now();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "checkpoint_bench: cannot create '", path, "'");
  for (int64_t done = 0; done < bytes;) {
    const ssize_t n = ::write(fd, data.data() + done, static_cast<size_t>(bytes - done));
    TORCH_CHECK(n > 0, "checkpoint_bench: writing '", path, "' failed");
    done += n;
  }
  TORCH_CHECK(::fsync(fd) == 0 && ::close(fd) == 0, "checkpoint_bench: fsync of '", path, "' failed");
  const double ms = ms_since(t0);
  ::unlink(path.c_str());
  return ms;
}

struct Flags {
  bench::ModelOptions model;
  int steps = 40, save_every = 5;
  std::string dir;
};

Flags parse(int argc, char** argv) {
  Flags f;
  f.model.kind = "gpt";
  f.model.layers = 4;
  f.model.hidden = 256;
  f.model.heads = 4;
  f.model.seq = 128;
  f.model.vocab = 4096;
  f.model.batch = 2;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--dir") {
      f.dir = v;
      continue;
    }
    const long n = std::strtol(v.c_str(), nullptr, 10);
    if (a == "--layers")
      f.model.layers = n;
    else if (a == "--hidden")
      f.model.hidden = n;
    else if (a == "--heads")
      f.model.heads = n;
    else if (a == "--seq")
      f.model.seq = n;
    else if (a == "--vocab")
      f.model.vocab = n;
    else if (a == "--batch")
      f.model.batch = n;
    else if (a == "--steps")
      f.steps = static_cast<int>(n);
    else if (a == "--save-every")
      f.save_every = static_cast<int>(n);
    else
      TORCH_CHECK(false, "checkpoint_bench: unknown flag '", a, "'");
  }
  TORCH_CHECK(!f.dir.empty() && f.save_every > 0, "checkpoint_bench: --dir DIR is required; --save-every >= 1");
  return f;
}

void run(const Flags& f, meshddp::DeviceMesh& mesh, bool async) {
  auto model = bench::make_bench_model(f.model);
  meshddp::DistributedDataParallel<bench::BenchModel> ddp(model, mesh, "dp");
  torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-4));
  const bench::Batch batch = bench::make_batch(f.model, mesh.rank());
  meshddp::CheckpointSaver saver({model.get(), &ddp, nullptr, &adamw});
  const std::string dir = f.dir + (async ? "/async" : "/sync");
  meshddp::CheckpointSaveOptions options;
  options.async_save = async;
  options.keep_last = 2;
  std::vector<double> stalls, plain_steps, writing_steps, write_mb_s, plain_mb_s;
  int64_t file_bytes = 0;
  bool writing = false;
  for (int step = 0; step < f.steps; ++step) {
    const auto t0 = Clock::now();
    const meshddp::AsyncSaveReport r = saver.step_boundary();
    if (r.kind == meshddp::AsyncSaveReport::Kind::kCommitted) {
      write_mb_s.push_back(r.file_bytes / 1e3 / r.write_ms);
      file_bytes = r.file_bytes;
    }
    ddp.zero_grad_buffer();
    model->loss(ddp.forward(batch.input), batch.target).backward();
    ddp.finish_grad_sync();
    adamw.step();
    const double step_ms = ms_since(t0);
    if (step >= 2) (writing ? writing_steps : plain_steps).push_back(step_ms);  // 2 warm-up steps
    writing = saver.pending();
    if ((step + 1) % f.save_every == 0) {
      const meshddp::AsyncSaveStart s = saver.save(dir, step + 1, {}, options);
      stalls.push_back(s.stall_ms());
      writing = saver.pending();
    }
  }
  const meshddp::AsyncSaveReport last = saver.wait();
  if (last.kind == meshddp::AsyncSaveReport::Kind::kCommitted) {
    write_mb_s.push_back(last.file_bytes / 1e3 / last.write_ms);
    file_bytes = last.file_bytes;
  }
  if (!async) {  // no report: the newest file's size
    const std::string file =
        dir + "/step-" + std::to_string(f.steps - f.steps % f.save_every) + "/rank00000.safetensors";
    struct stat st{};
    TORCH_CHECK(::stat(file.c_str(), &st) == 0, "checkpoint_bench: no '", file, "'");
    file_bytes = st.st_size;
  }
  for (int k = 0; k < 3; ++k) plain_mb_s.push_back(file_bytes / 1e3 / plain_write_ms(dir + "/plain-write", file_bytes));
  if (mesh.rank() != 0) return;
  std::printf("%-5s saves %zu  stall median %.1f ms max %.1f ms | step without a save: median %.1f ms",
              async ? "async" : "sync", stalls.size(), median(stalls), max_of(stalls), median(plain_steps));
  if (async) std::printf(", while writing: median %.1f ms max %.1f ms", median(writing_steps), max_of(writing_steps));
  std::printf("\n      rank 0 file %.1f MB", file_bytes / 1e6);
  if (async) std::printf(": background write %.0f MB/s median (write, fsync, read back, CRC32C)", median(write_mb_s));
  std::printf("; plain write + fsync of the same bytes %.0f MB/s median\n", median(plain_mb_s));
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Flags f = parse(argc, argv);
    torch::manual_seed(0);
    const char* world = std::getenv("WORLD_SIZE");
    auto mesh = meshddp::DeviceMesh::from_env({world ? std::atoll(world) : 1}, {"dp"});
    if (mesh.rank() == 0) {
      std::printf("checkpoint_bench: %s, DDP + AdamW at DP %lld, %d steps, a save every %d\n",
                  bench::describe(f.model).c_str(), static_cast<long long>(mesh.world_size()), f.steps, f.save_every);
    }
    run(f, mesh, /*async=*/false);
    run(f, mesh, /*async=*/true);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "checkpoint_bench: %s\n", e.what_without_backtrace());
    return 1;
  }
  return 0;
}
