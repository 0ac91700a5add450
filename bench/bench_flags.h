// ddp_bench's command line: the flags, their defaults, the --preset that sets several at once, and
// the checks. Values are read by the examples' strict parsers (examples/common/flags.h, header-only
// and torch-free: the one flag parser of the programs on the top floor), so a bad flag reads as it
// does in the examples: "error: --reps must be in [1, ...], got 0", the usage, exit 2.
#pragma once

#include <cstdint>
#include <string>

namespace bench {

struct Flags {
  std::string mode = "main";
  std::string preset;          // "" or gpt1b (set_preset)
  std::string model = "mlp";   // mlp or gpt (bench/bench_models.h)
  std::string dtype = "fp32";  // fp32 or bf16: the params, and the float inputs
  int64_t layers = 24;
  int64_t hidden = 1024;
  int64_t heads = 16, seq = 1024, vocab = 32000;  // gpt only
  int64_t batch = 32;                             // per rank: MLP rows, GPT sequences
  int warmup = 3;
  int reps = 10;
  double bucket_mb = 40;               // meshddp and the Reducer's bucket cap
  double reducer_first_bucket_mb = 1;  // torch DDP's _DEFAULT_FIRST_BUCKET_BYTES
  std::string candidates =
      "local,meshddp,meshddp_autograd,meshddp_no_overlap,meshddp_zero1,reducer_view,reducer_copy,naive";
  std::string sweep_mb = "1,2,5,10,20,40,100";
  int collective_reps = 5;  // 0: no standalone collectives (no "collectives" in the JSON)
  int threads = 0;          // 0: cores / local ranks
  std::string json;
  uint64_t seed = 0;
  std::string optimizer = "sgd";    // sgd (momentum 0.9) or adamw
  std::string device = "cpu";       // cpu, or cuda (NCCL groups, GPU cuda:LOCAL_RANK; docs/reference/gpu.md)
  int64_t optimizer_instances = 2;  // meshddp_zero1_instances: DdpConfig::num_distributed_optimizer_instances
};

// Prints "error: <bad>" and the usage, exits 2.
[[noreturn]] void usage_and_exit(const char* prog, const std::string& bad);
// The flags of argv; a bad one exits through usage_and_exit. --help / -h prints the usage, exits 0.
Flags parse_flags(int argc, char** argv);

}  // namespace bench
