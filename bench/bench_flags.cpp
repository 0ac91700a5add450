#include "bench/bench_flags.h"

#include <cstdlib>
#include <iostream>
#include <stdexcept>

namespace bench {

[[noreturn]] void usage_and_exit(const char* prog, const std::string& bad) {
  std::cerr << "error: " << bad << "\nusage: " << prog
            << " [--mode main|sweep] [--preset gpt1b] [--model mlp|gpt] [--dtype fp32|bf16] [--layers N] [--hidden N]"
               " [--heads N] [--seq N] [--vocab N] [--batch N] [--warmup N] [--reps N]"
               " [--bucket-mb X] [--reducer-first-bucket-mb X] [--candidates a,b,...] [--sweep-mb a,b,...]"
               " [--collective-reps N] [--threads N] [--seed N] [--optimizer sgd|adamw] [--device cpu|cuda] [--json PATH]\n";
  std::exit(2);
}

// --preset gpt1b: issue 10's "~1B-parameter bf16 transformer" at world size 1 on one 80 GB GPU.
// 18 blocks of hidden 2048: 18 x (12 h^2 + 13 h) = 906.4M, + token and position embeddings (65.5M +
// 2.1M) + the untied LM head (65.5M) = 1,039,622,144 params. Memory with SGD momentum, every
// candidate alive at once: local and meshddp hold param + grad + momentum in bf16 = 6 B/param =
// 6.2 GB each; meshddp_fp32_grads 2 + 4 (fp32 grads) + 4 (fp32 master) + 4 (fp32 momentum) =
// 14 B = 14.6 GB; meshddp_zero1 2 + 2 + 4 + 4 + 4 (fp32 grad scratch) = 16 B = 16.6 GB. Activations
// (one candidate at a time): about 34 s h bytes per block and sequence in bf16 (Korthikanti et al.
// 2022 without dropout; flash attention keeps no s x s scores) = 71 MB x 18 = 1.3 GB, plus the
// logits (bf16, their fp32 copy, log-softmax and gradients: ~0.4 GB) = ~1.7 GB per sequence; batch 8
// = ~14 GB. So local,meshddp,meshddp_fp32_grads need ~41 GB and adding meshddp_zero1 ~58 GB: fits
// in 80 GB with room for the allocator. 8 x 1024 tokens = 5.5e13 FLOP per step (~0.15-0.25 s).
void set_preset(Flags& f, const std::string& name) {
  if (name != "gpt1b") return;
  f.preset = name, f.model = "gpt", f.dtype = "bf16", f.layers = 18, f.hidden = 2048, f.heads = 16, f.seq = 1024;
  f.vocab = 32000, f.batch = 8;
}

// A preset first (wherever it stands), then every other flag, which overrides it.
Flags parse_flags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::string(argv[i]) != "--preset") continue;
    set_preset(f, argv[i + 1]);
    if (f.preset.empty()) usage_and_exit(argv[0], std::string("unknown --preset '") + argv[i + 1] + "' (known: gpt1b)");
  }
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) usage_and_exit(argv[0], "flag " + arg + " needs a value");
    const std::string v = argv[++i];
    try {
      if (arg == "--mode") f.mode = v;
      else if (arg == "--preset") continue;
      else if (arg == "--model") f.model = v;
      else if (arg == "--dtype") f.dtype = v;
      else if (arg == "--layers") f.layers = std::stoll(v);
      else if (arg == "--hidden") f.hidden = std::stoll(v);
      else if (arg == "--heads") f.heads = std::stoll(v);
      else if (arg == "--seq") f.seq = std::stoll(v);
      else if (arg == "--vocab") f.vocab = std::stoll(v);
      else if (arg == "--batch") f.batch = std::stoll(v);
      else if (arg == "--warmup") f.warmup = std::stoi(v);
      else if (arg == "--reps") f.reps = std::stoi(v);
      else if (arg == "--bucket-mb") f.bucket_mb = std::stod(v);
      else if (arg == "--reducer-first-bucket-mb") f.reducer_first_bucket_mb = std::stod(v);
      else if (arg == "--candidates") f.candidates = v;
      else if (arg == "--sweep-mb") f.sweep_mb = v;
      else if (arg == "--collective-reps") f.collective_reps = std::stoi(v);
      else if (arg == "--threads") f.threads = std::stoi(v);
      else if (arg == "--seed") f.seed = std::stoull(v);
      else if (arg == "--json") f.json = v;
      else if (arg == "--optimizer") f.optimizer = v;
      else if (arg == "--device") f.device = v;
      else usage_and_exit(argv[0], "unknown flag " + arg);
    } catch (const std::logic_error&) {
      usage_and_exit(argv[0], "flag " + arg + " has a bad value '" + v + "'");
    }
  }
  if (f.optimizer != "sgd" && f.optimizer != "adamw") usage_and_exit(argv[0], "--optimizer must be sgd or adamw");
  if (f.mode != "main" && f.mode != "sweep") usage_and_exit(argv[0], "--mode must be main or sweep");
  if (f.device != "cpu" && f.device != "cuda") usage_and_exit(argv[0], "--device must be cpu or cuda");
  if (f.model != "mlp" && f.model != "gpt") usage_and_exit(argv[0], "--model must be mlp or gpt");
  if (f.dtype != "fp32" && f.dtype != "bf16") usage_and_exit(argv[0], "--dtype must be fp32 or bf16");
  if (f.reps < 1 || f.warmup < 0 || f.layers < 1 || f.hidden < 1 || f.batch < 1) usage_and_exit(argv[0], "bad sizes");
  if (f.model == "gpt" && (f.heads < 1 || f.hidden % f.heads != 0 || f.seq < 1 || f.vocab < 2)) {
    usage_and_exit(argv[0], "GPT sizes: --heads must divide --hidden (" + std::to_string(f.hidden) + " % " +
                                std::to_string(f.heads) + "), --seq >= 1, --vocab >= 2");
  }
  return f;
}

}  // namespace bench
