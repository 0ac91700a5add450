#include "bench/bench_flags.h"

#include "examples/common/flags.h"

#include <limits>

namespace bench {

using examples::exit_with_help;
using examples::exit_with_usage;
using examples::FlagError;
using examples::parse_choice_flag;
using examples::parse_float_flag;
using examples::parse_int_flag;

namespace {

const char* usage() {
  return "[--mode main|sweep] [--preset gpt1b] [--model mlp|gpt] [--dtype fp32|bf16] [--layers N] [--hidden N]"
         " [--heads N] [--seq N] [--vocab N] [--batch N] [--warmup N] [--reps N]"
         " [--bucket-mb X] [--reducer-first-bucket-mb X] [--candidates a,b,...] [--sweep-mb a,b,...]"
         " [--collective-reps N] [--threads N] [--seed N] [--optimizer sgd|adamw] [--device cpu|cuda] "
         "[--optimizer-instances K] [--json PATH]";
}

}  // namespace

[[noreturn]] void usage_and_exit(const char* prog, const std::string& bad) { exit_with_usage(prog, bad, usage()); }

// --preset gpt1b: the ~1B-parameter bf16 transformer at world size 1 on one 80 GB GPU.
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
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") exit_with_help(argv[0], usage());
    if (i + 1 >= argc) usage_and_exit(argv[0], "flag " + arg + " needs a value");
    const std::string v = argv[++i];
    try {
      if (arg == "--mode")
        f.mode = parse_choice_flag(arg, v, {"main", "sweep"});
      else if (arg == "--preset")
        continue;
      else if (arg == "--model")
        f.model = parse_choice_flag(arg, v, {"mlp", "gpt"});
      else if (arg == "--dtype")
        f.dtype = parse_choice_flag(arg, v, {"fp32", "bf16"});
      else if (arg == "--layers")
        f.layers = parse_int_flag(arg, v, 1);
      else if (arg == "--hidden")
        f.hidden = parse_int_flag(arg, v, 1);
      else if (arg == "--heads")
        f.heads = parse_int_flag(arg, v, 1);
      else if (arg == "--seq")
        f.seq = parse_int_flag(arg, v, 1);
      else if (arg == "--vocab")
        f.vocab = parse_int_flag(arg, v, 2);
      else if (arg == "--batch")
        f.batch = parse_int_flag(arg, v, 1);
      else if (arg == "--warmup")
        f.warmup = static_cast<int>(parse_int_flag(arg, v, 0, kIntMax));
      else if (arg == "--reps")
        f.reps = static_cast<int>(parse_int_flag(arg, v, 1, kIntMax));
      else if (arg == "--bucket-mb")
        f.bucket_mb = parse_float_flag(arg, v, 0.0, true);
      else if (arg == "--reducer-first-bucket-mb")
        f.reducer_first_bucket_mb = parse_float_flag(arg, v, 0.0, true);
      else if (arg == "--candidates")
        f.candidates = v;
      else if (arg == "--sweep-mb")
        f.sweep_mb = v;
      else if (arg == "--collective-reps")
        f.collective_reps = static_cast<int>(parse_int_flag(arg, v, 0, kIntMax));
      else if (arg == "--threads")
        f.threads = static_cast<int>(parse_int_flag(arg, v, 0, kIntMax));
      else if (arg == "--seed")
        f.seed = static_cast<uint64_t>(parse_int_flag(arg, v, 0));
      else if (arg == "--json")
        f.json = v;
      else if (arg == "--optimizer")
        f.optimizer = parse_choice_flag(arg, v, {"sgd", "adamw"});
      else if (arg == "--device")
        f.device = parse_choice_flag(arg, v, {"cpu", "cuda"});
      else if (arg == "--optimizer-instances")
        f.optimizer_instances = parse_int_flag(arg, v, 1);
      else
        usage_and_exit(argv[0], "unknown flag " + arg);
    } catch (const FlagError& e) {
      usage_and_exit(argv[0], e.what());
    }
  }
  if (f.model == "gpt" && f.hidden % f.heads != 0) {
    usage_and_exit(argv[0], "GPT sizes: --heads must divide --hidden (" + std::to_string(f.hidden) + " % " +
                                std::to_string(f.heads) + " != 0)");
  }
  return f;
}

}  // namespace bench
