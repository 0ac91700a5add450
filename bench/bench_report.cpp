#include "bench/bench_report.h"

#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

namespace bench {
namespace {

std::string phases_json(const std::vector<Phases>& v) {
  std::vector<double> fwd, bwd, sync, opt, total;
  for (const auto& p : v) {
    fwd.push_back(p.fwd), bwd.push_back(p.bwd), sync.push_back(p.sync), opt.push_back(p.opt), total.push_back(p.total);
  }
  std::ostringstream o;
  o.precision(6);
  o << "\"median_ms\": {\"fwd\": " << median(fwd) << ", \"bwd\": " << median(bwd) << ", \"sync\": " << median(sync)
    << ", \"opt\": " << median(opt) << ", \"total\": " << median(total) << "}, \"total_ms\": " << json_num_list(total)
    << ", \"sync_ms\": " << json_num_list(sync);
  return o.str();
}

double median_total(const std::vector<Phases>& v) {
  std::vector<double> t;
  for (const auto& p : v) t.push_back(p.total);
  return median(t);
}

// The run's settings, as the JSON file's first fields.
void write_json_settings(std::ostream& out, const Bench& bench, const RunReport& r) {
  const Flags& flags = bench.flags;
  out << "{\n\"mode\": \"" << flags.mode << "\",\n\"world\": " << bench.world
      << ",\n\"threads_per_rank\": " << r.threads << ",\n\"device\": \"" << bench.mesh.device() << "\",\n\"preset\": \""
      << flags.preset << "\",\n\"model\": \"" << flags.model << "\",\n\"dtype\": \"" << flags.dtype
      << "\",\n\"layers\": " << flags.layers << ",\n\"hidden\": " << flags.hidden;
  if (flags.model == "gpt")
    out << ",\n\"heads\": " << flags.heads << ",\n\"seq\": " << flags.seq << ",\n\"vocab\": " << flags.vocab;
  out << ",\n\"batch_per_rank\": " << flags.batch << ",\n\"params\": " << bench.param_numel
      << ",\n\"warmup\": " << flags.warmup << ",\n\"reps\": " << flags.reps << ",\n\"optimizer\": \"" << flags.optimizer
      << "\"" << ",\n\"bucket_mb\": " << flags.bucket_mb
      << ",\n\"reducer_first_bucket_mb\": " << flags.reducer_first_bucket_mb << ",\n\"loadavg_start\": \""
      << r.loadavg_start << "\",\n\"loadavg_end\": \"" << r.loadavg_end
      << "\",\n\"hardware_concurrency\": " << std::thread::hardware_concurrency() << ",\n";
}

}  // namespace

std::string loadavg() {
  std::ifstream in("/proc/loadavg");
  std::string line;
  std::getline(in, line);
  return line;
}

std::string Collectives::json() const {
  if (!measured) return "";
  std::ostringstream coll;
  coll << "\"collectives\": {\"bucket_numels\": " << json_int_list(bucket_numels)
       << ", \"bucket_all_reduce_ms\": " << json_num_list(bucket_all_reduce_ms)
       << ", \"zero1_bucket_numels\": " << json_int_list(zero1_numels)
       << ", \"zero1_bucket_reduce_scatter_ms\": " << json_num_list(zero1_reduce_scatter_ms)
       << ", \"zero1_bucket_all_gather_ms\": " << json_num_list(zero1_all_gather_ms)
       << ", \"all_reduce_sweep_bytes\": " << json_int_list(sweep_bytes)
       << ", \"all_reduce_sweep_ms\": " << json_num_list(sweep_ms) << "},\n";
  return coll.str();
}

Collectives measure_collectives(Bench& bench, const std::vector<std::unique_ptr<Candidate>>& cands) {
  Collectives c;
  if (bench.flags.mode != "main" || bench.flags.collective_reps <= 0) return c;
  c.measured = true;
  for (const auto& cand : cands) {
    if (cand->name == "meshddp" || (cand->name == "meshddp_no_overlap" && c.bucket_numels.empty())) {
      c.bucket_numels = cand->bucket_numels;
    }
    if (cand->name == "meshddp_zero1") c.zero1_numels = cand->bucket_numels;
  }
  for (int64_t n : c.bucket_numels) c.bucket_all_reduce_ms.push_back(bench.time_collective(n, "all_reduce"));
  for (int64_t n : c.zero1_numels) c.zero1_reduce_scatter_ms.push_back(bench.time_collective(n, "reduce_scatter"));
  for (int64_t n : c.zero1_numels) c.zero1_all_gather_ms.push_back(bench.time_collective(n, "all_gather"));
  for (int64_t bytes = 4 << 10; bytes <= (64 << 20); bytes *= 4) {
    c.sweep_bytes.push_back(bytes);
    c.sweep_ms.push_back(bench.time_collective(bytes / 4, "all_reduce"));
  }
  return c;
}

void print_header(const Bench& bench, int threads, const std::string& loadavg_start) {
  const Flags& flags = bench.flags;
  const int64_t numel = bench.param_numel;
  const bool gpt = flags.model == "gpt";
  std::printf(
      "# meshddp bench (%s%s%s): %s, %s = %lld params (%.1f MB), batch %lld %s per rank, %s, %d intra-op "
      "thread(s) per rank, %d warm-up + %d reps\n# loadavg at start: %s\n",
      flags.mode.c_str(), flags.preset.empty() ? "" : ", preset ", flags.preset.c_str(), bench.mesh.describe().c_str(),
      describe(bench.model_opts).c_str(), static_cast<long long>(numel),
      numel * c10::elementSize(bench.model_opts.dtype) / 1e6, static_cast<long long>(flags.batch),
      gpt ? ("sequences of " + std::to_string(flags.seq) + " tokens").c_str() : "rows", flags.optimizer.c_str(),
      threads, flags.warmup, flags.reps, loadavg_start.c_str());
  std::fflush(stdout);
}

void print_table(const Bench& bench, const std::vector<std::unique_ptr<Candidate>>& cands, const RunReport& r) {
  std::map<std::string, double> med;
  for (size_t i = 0; i < cands.size(); ++i) med[cands[i]->name] = median_total(r.results[i]);
  std::printf("\n%-24s %9s %9s %9s %9s %9s %10s  %s\n", "candidate", "step_ms", "fwd", "bwd", "sync", "opt",
              "last_loss", "grad+comm MB / opt-state MB");
  for (size_t i = 0; i < cands.size(); ++i) {
    std::vector<double> f, b, s, o;
    for (const auto& p : r.results[i]) f.push_back(p.fwd), b.push_back(p.bwd), s.push_back(p.sync), o.push_back(p.opt);
    std::printf("%-24s %9.1f %9.1f %9.1f %9.1f %9.1f %10.6f  %.1f / %.1f\n", cands[i]->name.c_str(),
                med[cands[i]->name], median(f), median(b), median(s), median(o), r.losses[i],
                r.memory[i].grad_and_comm_bytes / 1e6, r.memory[i].optimizer_state_bytes / 1e6);
  }
  auto ratio = [&](const char* a, const char* b) {
    if (med.count(a) && med.count(b) && med[b] > 0) std::printf("  %s / %s = %.3f\n", a, b, med[a] / med[b]);
  };
  std::printf("\nratios of median step time:\n");
  for (const auto& c : cands) {
    if (c->name != "local") ratio(c->name.c_str(), "local");
  }
  for (const char* base : {"reducer_view", "reducer_copy", "naive"}) ratio("meshddp", base);
  ratio("meshddp_zero1", "reducer_view");
  ratio("meshddp_zero1", "meshddp");
  ratio("meshddp_fp32_grads", "meshddp");
  ratio("meshddp_bf16", "reducer_bf16");
  const auto& ar = r.collectives.bucket_all_reduce_ms;
  if (!ar.empty()) {
    double sum = 0;
    for (double v : ar) sum += v;
    std::printf("\nstandalone bucket all-reduces (meshddp layout, %zu buckets): sum %.1f ms, last bucket %.1f ms\n",
                ar.size(), sum, ar.back());
  }
  if (bench.flags.mode == "sweep") {
    std::printf("\n(sweep) step time vs bucket size; default is 40 MiB\n");
  }
  std::printf("# loadavg at end: %s\n", r.loadavg_end.c_str());
}

void write_json(const Bench& bench, const std::vector<std::unique_ptr<Candidate>>& cands, const RunReport& r,
                const ReadyTimeline& local_timeline, const ReadyTimeline& meshddp_timeline) {
  std::ofstream out(bench.flags.json);
  out.precision(8);
  write_json_settings(out, bench, r);
  out << r.collectives.json();
  for (const auto* tl : {&local_timeline, &meshddp_timeline}) {
    if (tl->steps.empty()) continue;
    out << "\"" << (tl == &local_timeline ? "local" : "meshddp")
        << "_grad_ready_ms\": {\"names\": " << json_str_list(tl->names) << ", \"numels\": " << json_int_list(tl->numels)
        << ", \"ready_ms\": " << json_num_list(tl->medians()) << "},\n";
  }
  out << "\"candidates\": [\n";
  for (size_t i = 0; i < cands.size(); ++i) {
    out << "  {\"name\": \"" << cands[i]->name << "\", " << phases_json(r.results[i])
        << ", \"grad_and_comm_bytes\": " << r.memory[i].grad_and_comm_bytes
        << ", \"optimizer_state_bytes\": " << r.memory[i].optimizer_state_bytes
        << ", \"param_bytes\": " << r.memory[i].param_bytes << ", \"last_loss\": " << r.losses[i];
    if (cands[i]->extra_json) out << ", " << cands[i]->extra_json();
    out << "}" << (i + 1 < cands.size() ? "," : "") << "\n";
  }
  out << "]\n}\n";
  std::printf("# wrote %s\n", bench.flags.json.c_str());
}

}  // namespace bench
