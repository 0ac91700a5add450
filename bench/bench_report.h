// ddp_bench's output: the header line, the table of medians and ratios on stdout, and the JSON file
// (--json) that bench/plot.py, bench/cost_model.py and tests/bench/check_ddp_bench.py read; plus the
// standalone collectives measured for it. Formats are fixed: those readers parse them.
#pragma once

#include "bench/bench.h"

#include <memory>
#include <string>
#include <vector>

namespace bench {

// Standalone collective times (--mode main with --collective-reps > 0): meshddp's bucket sizes
// (all-reduce; ZeRO-1's: reduce-scatter + all-gather) and an all-reduce size sweep for alpha/beta.
struct Collectives {
  std::vector<int64_t> bucket_numels, zero1_numels, sweep_bytes;
  std::vector<double> bucket_all_reduce_ms, zero1_reduce_scatter_ms, zero1_all_gather_ms, sweep_ms;
  bool measured = false;
  std::string json() const;  // "" when not measured, else `"collectives": {...},\n`
};
Collectives measure_collectives(Bench& bench, const std::vector<std::unique_ptr<Candidate>>& cands);

// Everything a finished run reports (results[i], memory[i], losses[i] belong to candidates[i]).
struct RunReport {
  std::vector<std::vector<Phases>> results;
  std::vector<Memory> memory;
  std::vector<double> losses;  // this rank's loss at the last step: the candidates train the same model
  Collectives collectives;
  int threads = 1;
  std::string loadavg_start, loadavg_end;
};

std::string loadavg();  // /proc/loadavg's line

// "# meshddp bench (...): <mesh>, <model> = N params (X MB), batch ..., intra-op threads, reps".
void print_header(const Bench& bench, int threads, const std::string& loadavg_start);
// The table of medians per candidate, the ratios of median step times, the bucket all-reduce sum.
void print_table(const Bench& bench, const std::vector<std::unique_ptr<Candidate>>& cands, const RunReport& r);
// The --json file; `timelines` are local's and meshddp's gradient-ready timelines (either may be empty).
void write_json(const Bench& bench, const std::vector<std::unique_ptr<Candidate>>& cands, const RunReport& r,
                const ReadyTimeline& local_timeline, const ReadyTimeline& meshddp_timeline);

}  // namespace bench
