// ddp_bench's run: the context every candidate shares (flags, the DP group, this rank's batch, the
// model options), the candidates' factories (bench/candidates.cpp) and the interleaved timing loop
// and standalone collectives (bench/bench_run.cpp). Printing and JSON are in bench/bench_report.h.
#pragma once

#include "bench/bench_flags.h"
#include "bench/bench_models.h"
#include "bench/candidate.h"
#include "grad_buffer/comm_hook.h"
#include "mesh/device_mesh.h"

#include <memory>
#include <string>
#include <vector>

namespace bench {

// What a meshddp candidate varies (DdpConfig fields, and the optimizer that goes with them).
struct MeshddpSetup {
  bool zero1 = false;           // use_distributed_optimizer, stepped by meshddp's DistributedOptimizer
  bool overlap = true;          // overlap_grad_reduce
  bool grads_in_buffer = true;  // linear_with_grad_in_buffer + gradient_accumulation_fusion
  std::string comm_hook = meshddp::kNoCommHook;
  bool fp32_grads = false;  // grad_reduce_in_fp32: bf16 params get fp32 main grads (and, without
                            // zero1, fp32 masters: Fp32Masters); same as meshddp for fp32 params
  int64_t instances = 1;    // num_distributed_optimizer_instances (hierarchical ZeRO-1, with zero1)
};

// The model options --model, --layers, ... --dtype, --device ask for.
ModelOptions model_options(const Flags& f);

struct Bench {
  Flags flags;
  meshddp::DeviceMesh mesh;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  int64_t world = 1, rank = 0;
  ModelOptions model_opts;
  Batch batch;  // this rank's fixed input and target
  int64_t param_numel = 0;

  Bench(Flags f, meshddp::DeviceMesh m);

  void barrier();
  // A fresh model from the seed (every candidate builds its own); sets param_numel.
  std::shared_ptr<BenchModel> make_model();

  // --- candidates (bench/candidates.cpp) --------------------------------------------------------
  std::unique_ptr<Candidate> make_local(ReadyTimeline* timeline);
  std::unique_ptr<Candidate> make_meshddp(const std::string& name, double bucket_mb, const MeshddpSetup& setup,
                                          ReadyTimeline* timeline);
  std::unique_ptr<Candidate> make_reducer(bool view, bool bf16 = false);
  std::unique_ptr<Candidate> make_naive();

  // --- running (bench/bench_run.cpp) ------------------------------------------------------------
  // Warm-up, then reps; every repetition runs each candidate once, in an order rotated per repetition.
  // Returns per candidate, per rep, the phases: total as the max over ranks, the others as the mean.
  std::vector<std::vector<Phases>> run(std::vector<std::unique_ptr<Candidate>>& cands);
  // Median time (max over ranks) of a standalone collective on a fresh buffer of `numel` fp32;
  // kind: all_reduce, reduce_scatter or all_gather.
  double time_collective(int64_t numel, const std::string& kind);
};

}  // namespace bench
