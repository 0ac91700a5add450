// ddp_bench's timing loop: warm-up, then repetitions that run every candidate once each, in an
// order rotated per repetition with a barrier before each step; the phases reduced over ranks (a
// step's total as the max, its phases as the mean); and standalone collectives timed alone.
#include "bench/bench.h"
#include "mesh/collectives.h"

#include <cstdio>

namespace bench {
namespace {

// In-place MAX all-reduce of a CPU or device tensor, waited.
void all_reduce_max(c10d::ProcessGroup& group, at::Tensor& t) {
  std::vector<at::Tensor> ts{t};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::MAX;
  group.allreduce(ts, o)->wait();
}

// Per candidate, per rep: a step takes as long as its slowest rank, so the total is the max over
// ranks; the phases are the mean over ranks (per-phase maxima would come from different ranks and
// add up to more than the step).
std::vector<std::vector<Phases>> reduce_over_ranks(const std::vector<std::unique_ptr<Candidate>>& cands, int reps,
                                                   c10d::ProcessGroup& group, int64_t world) {
  const size_t n = cands.size();
  auto t = torch::zeros({static_cast<int64_t>(n), reps, kPhases}, torch::kDouble);
  auto acc = t.accessor<double, 3>();
  for (size_t i = 0; i < n; ++i) {
    for (int r = 0; r < reps; ++r) {
      const Phases& p = cands[i]->timed[r];
      const double v[kPhases] = {p.fwd, p.bwd, p.sync, p.opt, p.total};
      for (int k = 0; k < kPhases; ++k) acc[i][r][k] = v[k];
    }
  }
  auto tmax = t.clone();
  all_reduce_max(group, tmax);
  std::vector<at::Tensor> tsum{t};
  group.allreduce(tsum)->wait();
  t.div_(static_cast<double>(world));
  auto amax = tmax.accessor<double, 3>();
  std::vector<std::vector<Phases>> out(n);
  for (size_t i = 0; i < n; ++i) {
    for (int r = 0; r < reps; ++r) {
      out[i].push_back(Phases{acc[i][r][0], acc[i][r][1], acc[i][r][2], acc[i][r][3], amax[i][r][4]});
    }
  }
  return out;
}

void set_recording(std::vector<std::unique_ptr<Candidate>>& cands, bool on) {
  for (auto& c : cands) {
    if (c->timeline) c->timeline->recording = on;
  }
}

}  // namespace

Bench::Bench(Flags f, meshddp::DeviceMesh m) : flags(std::move(f)), mesh(std::move(m)) {
  group = mesh["dp"];
  world = mesh.size("dp");
  rank = mesh.coordinate("dp");
  model_opts = model_options(flags);
  model_opts.device = mesh.device();
  batch = make_batch(model_opts, rank);
}

void Bench::barrier() { group->barrier()->wait(); }

std::shared_ptr<BenchModel> Bench::make_model() {
  auto model = make_bench_model(model_opts);
  param_numel = 0;
  for (const auto& p : model->parameters()) param_numel += p.numel();
  return model;
}

std::vector<std::vector<Phases>> Bench::run(std::vector<std::unique_ptr<Candidate>>& cands) {
  const size_t n = cands.size();
  for (int w = 0; w < flags.warmup; ++w) {
    for (auto& c : cands) {
      barrier();
      c->step();
    }
  }
  set_recording(cands, true);
  for (int r = 0; r < flags.reps; ++r) {
    for (size_t k = 0; k < n; ++k) {
      auto& c = cands[(k + static_cast<size_t>(r)) % n];
      barrier();
      c->timed.push_back(c->step());
    }
    if (rank == 0) {
      std::fprintf(stderr, "# rep %d/%d done\n", r + 1, flags.reps);
    }
  }
  set_recording(cands, false);
  return reduce_over_ranks(cands, flags.reps, *group, world);
}

double Bench::time_collective(int64_t numel, const std::string& kind) {
  auto buf = torch::ones({numel}, mesh.device());
  auto shard = torch::empty({numel / world}, mesh.device());
  std::vector<double> times;
  for (int r = 0; r < flags.collective_reps + 1; ++r) {
    barrier();
    auto t0 = Clock::now();
    if (kind == "all_reduce") {
      meshddp::all_reduce_sum_now(*group, buf, "standalone all-reduce");
    } else if (kind == "reduce_scatter") {
      auto w = meshddp::reduce_scatter_sum(*group, shard, buf.narrow(0, 0, shard.numel() * world), "standalone rs");
      meshddp::wait_collective(w, *group, "standalone rs");
    } else {
      auto w = meshddp::all_gather_into(*group, buf.narrow(0, 0, shard.numel() * world), shard, "standalone ag");
      meshddp::wait_collective(w, *group, "standalone ag");
    }
    auto t1 = Clock::now();
    if (r > 0) times.push_back(ms_since(t0, t1));  // the first is a warm-up
  }
  auto t = torch::tensor(times, torch::kDouble);
  all_reduce_max(*group, t);
  return median(std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel()));
}

}  // namespace bench
