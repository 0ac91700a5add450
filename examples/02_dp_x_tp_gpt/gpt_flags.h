// Example 02's flags: the Flags struct, strict parsing and the cross-flag checks (a bad combination
// exits with status 2 naming the flags before any rank builds a mesh). Flags: docs/reference/examples.md.
#pragma once

#include "examples/02_dp_x_tp_gpt/gpt.h"
#include "examples/common/checkpointing.h"
#include "examples/common/flags.h"
#include "examples/common/precision.h"
#include "examples/common/run_flags.h"

#include <string>

namespace gpt {

struct Flags {
  int64_t dp = 1, cp = 1, tp = 1;
  int64_t ep = 1;  // expert-parallel size (--ep); the number of experts and top-k are in `model`
  bool sequence_parallel = false, distributed_optimizer = false;
  // --optimizer-instances K: hierarchical ZeRO-1 (num_distributed_optimizer_instances)
  int64_t optimizer_instances = 1;
  // --data-parallel-sharding-strategy no_shard|optim|optim_grads|optim_grads_params (DdpConfig's;
  // docs/guide/sharding.md): "optim" is --distributed-optimizer, "optim_grads" also shards the gradients,
  // "optim_grads_params" the params too (one FSDP unit per block: DdpConfig::fsdp_unit_modules' default). "" = not
  // given
  std::string sharding_strategy;
  int64_t bucket_bytes = -1;  // --bucket-bytes N: DdpConfig::bucket_bytes; -1 = its default
  int64_t global_batch = 16;
  // Per DP rank and step. Without a pipeline: backward accumulates, the last one syncs. With one: the
  // schedule's micro-batches (each chunk's sync held until its last backward micro-batch).
  int64_t micro_batches = 1;
  uint64_t seed = 0;
  examples::PrecisionFlags precision;  // --dtype, --grad-reduce-in-bf16
  // --optimizer adamw|sgd|muon (SGD: a wrong gradient scale shows; AdamW hides it; muon: Muon on the block
  // matrices, AdamW on the rest, whole-param ZeRO-1 shards)
  std::string optimizer = "adamw";
  examples::RunFlags run;  // --steps, --lr and schedule, logging, --inject-nan, timeouts
  gpt::Config model;
  examples::CheckpointFlags checkpoints;
  // --loss mean|per-token. mean: the mean over every token of the global batch (all are valid).
  // per-token: sequences end early (gpt::valid_mask: padding after a random length), the loss is the sum
  // over valid tokens divided by the global batch's count of valid tokens (Megatron's
  // calculate_per_token_loss), never a mean of per-micro-batch means.
  bool per_token_loss = false;
  // Pipeline parallel (pipeline_train.h): given --pp or --vpp, the model is cut into pp x vpp chunks
  // over a "pp" mesh dim, vpp per rank (vpp 1: the 1F1B schedule; vpp > 1: the interleaved one), each
  // DP rank's share of the global batch split into `micro_batches`.
  bool pipeline = false;
  int64_t pp = 1, vpp = 1;
  // --grad-sync bubble|end: start each chunk's DP gradient sync when its last backward ends (in the
  // pipeline's bubble, overlapping the other chunks' backward), or hold all of it until the schedule
  // ends (the baseline the benchmark compares with).
  bool sync_at_end = false;
  // --clip-grad X: clip the global gradient L2 norm (every DP, TP and pipeline rank's share, each element
  // once) to X before the step, Megatron's --clip-grad and its default; 0 = off.
  double clip_grad = 1.0;
};

inline std::string usage_line() {
  return std::string(
             "--dp N [--cp N] --tp N [--sequence-parallel] [--distributed-optimizer [--optimizer-instances K]] "
             "[--data-parallel-sharding-strategy no_shard|optim|optim_grads|optim_grads_params] [--bucket-bytes N] "
             "[--optimizer adamw|sgd|muon] [--clip-grad X] "
             "[--global-batch N] [--micro-batches K] "
             "[--seed N] [--layers N] [--dim N] [--heads N] [--seq-len N] [--vocab N] [--experts N [--top-k K] [--ep "
             "N]] [--loss mean|per-token] [--pp N [--vpp N] [--grad-sync bubble|end]] ") +
         examples::precision_usage() + " " + examples::run_flags_usage() + examples::checkpoint_usage();
}

[[noreturn]] inline void usage(const char* prog, const std::string& error) {
  examples::exit_with_usage(prog, error, usage_line());
}

// Model and mesh flags that would otherwise fail deep inside (--heads 0 divides by zero on every rank).
inline void validate(Flags& f) {
  using examples::FlagError;
  if (f.sharding_strategy == "no_shard" && f.distributed_optimizer) {
    throw FlagError(
        "--data-parallel-sharding-strategy no_shard contradicts --distributed-optimizer (the 'optim' "
        "strategy); give one of them");
  }
  // Megatron's rule: "optim" is the distributed optimizer; "optim_grads" needs it too.
  if (f.sharding_strategy == "optim" || f.sharding_strategy == "optim_grads" ||
      f.sharding_strategy == "optim_grads_params")
    f.distributed_optimizer = true;
  const auto& m = f.model;
  const auto n = [](int64_t v) { return std::to_string(v); };
  if (m.dim % m.heads != 0) throw FlagError("--dim " + n(m.dim) + " must divide by --heads " + n(m.heads));
  if (m.heads % f.tp != 0)
    throw FlagError("--heads " + n(m.heads) + " must divide by --tp " + n(f.tp) + " (heads are split over TP)");
  if (m.vocab % f.tp != 0)
    throw FlagError("--vocab " + n(m.vocab) + " must divide by --tp " + n(f.tp) + " (the vocab is split over TP)");
  if (f.global_batch % (f.dp * f.micro_batches) != 0) {
    throw FlagError("--global-batch " + n(f.global_batch) + " must divide by --dp " + n(f.dp) +
                    (f.micro_batches > 1 ? " x --micro-batches " + n(f.micro_batches) : std::string()));
  }
  if (m.seq_len % f.cp != 0) {
    throw FlagError("--seq-len " + n(m.seq_len) + " must divide by --cp " + n(f.cp) +
                    " (each CP rank holds a slice of every sequence)");
  }
  if (f.sequence_parallel && m.seq_len % (f.cp * f.tp) != 0) {
    throw FlagError("--seq-len " + n(m.seq_len) + " must divide by --tp " + n(f.tp) +
                    (f.cp > 1 ? " x --cp " + n(f.cp) : std::string()) + " with --sequence-parallel");
  }
  if (m.experts == 0 && f.ep > 1)
    throw FlagError("--ep " + n(f.ep) + " needs --experts (a mixture of experts to spread)");
  if (m.experts > 0) {
    if (m.top_k > m.experts) throw FlagError("--top-k " + n(m.top_k) + " must be at most --experts " + n(m.experts));
    if (m.experts % f.ep != 0)
      throw FlagError("--experts " + n(m.experts) + " must divide by --ep " + n(f.ep) + " (each EP rank holds E / ep)");
    if ((f.dp * f.cp) % f.ep != 0) {
      throw FlagError("--ep " + n(f.ep) + " must divide --dp " + n(f.dp) + (f.cp > 1 ? " x --cp " + n(f.cp) : "") +
                      " (expert-parallel groups are carved out of the data-parallel ranks)");
    }
    if (f.sequence_parallel && f.tp > 1) {
      throw FlagError(
          "--sequence-parallel with --experts is not supported: the MoE layer routes whole tokens, which "
          "sequence parallelism splits over TP; drop one of them (--experts works with --tp without it)");
    }
  }
  if (f.pipeline) {
    const int64_t chunks = f.pp * f.vpp;
    if (m.layers % chunks != 0) {
      throw FlagError("--layers " + n(m.layers) + " must divide by --pp " + n(f.pp) + " x --vpp " + n(f.vpp) +
                      " (each model chunk holds layers / (pp x vpp) blocks)");
    }
    if (f.vpp > 1 && f.pp == 1)
      throw FlagError("--vpp " + n(f.vpp) + " needs --pp > 1 (it interleaves the chunks of several stages)");
    if (f.vpp > 1 && f.micro_batches % f.pp != 0) {
      throw FlagError("--micro-batches " + n(f.micro_batches) + " must divide by --pp " + n(f.pp) +
                      " with --vpp > 1 (the interleaved schedule runs micro-batches in groups of pp)");
    }
    if (m.experts > 0 || f.ep > 1)
      throw FlagError("--experts/--ep with --pp/--vpp are not supported yet; drop one of them");
    if (f.optimizer_instances > 1) {
      throw FlagError("--optimizer-instances " + n(f.optimizer_instances) +
                      " with --pp/--vpp is not supported yet; use flat ZeRO-1 (1)");
    }
  } else if (f.sync_at_end) {
    throw FlagError("--grad-sync end needs a pipeline (--pp)");
  }
  if (f.optimizer == "muon" && !f.distributed_optimizer) {
    throw FlagError("--optimizer muon needs --distributed-optimizer (Muon runs on whole-param ZeRO-1 shards)");
  }
  examples::validate_run_flags(f.run);
  examples::validate_precision_flags(f.precision, f.distributed_optimizer, f.checkpoints.any());
}

inline Flags parse(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") examples::exit_with_help(argv[0], usage_line());
    if (arg == "--sequence-parallel") {
      f.sequence_parallel = true;
      continue;
    }
    if (arg == "--pp" || arg == "--vpp") f.pipeline = true;
    if (arg == "--distributed-optimizer") {
      f.distributed_optimizer = true;
      continue;
    }
    if (examples::parse_precision_switch(arg, f.precision)) continue;
    if (examples::parse_checkpoint_flag(argc, argv, i, f.checkpoints)) continue;
    if (i + 1 >= argc) usage(argv[0], "flag " + arg + " needs a value");
    const std::string v = argv[++i];
    using examples::parse_int_flag;
    try {
      if (arg == "--dp")
        f.dp = parse_int_flag(arg, v, 1);
      else if (arg == "--tp")
        f.tp = parse_int_flag(arg, v, 1);
      else if (arg == "--cp")
        f.cp = parse_int_flag(arg, v, 1);
      else if (arg == "--optimizer-instances")
        f.optimizer_instances = parse_int_flag(arg, v, 1);
      else if (arg == "--pp")
        f.pp = parse_int_flag(arg, v, 1);
      else if (arg == "--vpp")
        f.vpp = parse_int_flag(arg, v, 1);
      else if (arg == "--clip-grad")
        f.clip_grad = examples::parse_float_flag(arg, v, 0.0, true);
      else if (arg == "--data-parallel-sharding-strategy")
        f.sharding_strategy =
            examples::parse_choice_flag(arg, v, {"no_shard", "optim", "optim_grads", "optim_grads_params"});
      else if (arg == "--bucket-bytes")
        f.bucket_bytes = parse_int_flag(arg, v, 0);
      else if (arg == "--micro-batches")
        f.micro_batches = parse_int_flag(arg, v, 1);
      else if (arg == "--loss")
        f.per_token_loss = examples::parse_choice_flag(arg, v, {"mean", "per-token"}) == "per-token";
      else if (arg == "--grad-sync")
        f.sync_at_end = examples::parse_choice_flag(arg, v, {"bubble", "end"}) == "end";
      else if (arg == "--ep")
        f.ep = parse_int_flag(arg, v, 1);
      else if (arg == "--experts")
        f.model.experts = parse_int_flag(arg, v, 0);
      else if (arg == "--top-k")
        f.model.top_k = parse_int_flag(arg, v, 1);
      else if (arg == "--global-batch")
        f.global_batch = parse_int_flag(arg, v, 1);
      else if (examples::parse_precision_flag(arg, v, f.precision))
        continue;
      else if (arg == "--seed")
        f.seed = static_cast<uint64_t>(parse_int_flag(arg, v, 0));
      else if (arg == "--optimizer") {
        if (v != "adamw" && v != "sgd" && v != "muon")
          throw examples::FlagError("--optimizer must be adamw, sgd or muon, got '" + v + "'");
        f.optimizer = v;
      } else if (arg == "--layers")
        f.model.layers = parse_int_flag(arg, v, 1);
      else if (arg == "--dim")
        f.model.dim = parse_int_flag(arg, v, 1);
      else if (arg == "--heads")
        f.model.heads = parse_int_flag(arg, v, 1);
      else if (arg == "--seq-len")
        f.model.seq_len = parse_int_flag(arg, v, 1);
      else if (arg == "--vocab")
        f.model.vocab = parse_int_flag(arg, v, 1);
      else if (!examples::parse_run_flag(arg, v, f.run))
        usage(argv[0], "unknown flag " + arg);
    } catch (const examples::FlagError& e) {
      usage(argv[0], e.what());
    }
  }
  try {
    validate(f);
  } catch (const examples::FlagError& e) {
    usage(argv[0], e.what());
  }
  return f;
}

// What a failed --resume adds to the load's error (ExampleCheckpoints::explain_load_failures): the
// checkpoint's tensors follow two flags. --pp/--vpp: the pipeline trainer keeps the tied LM head as a
// separate lm_head.weight (the last stage's copy), the plain one has wte.weight alone; --dtype: the
// params are saved in theirs (bf16 or fp32).
inline std::string resume_hint(const Flags& f) {
  const std::string dtype = f.precision.bf16 ? "bf16" : "fp32", other = f.precision.bf16 ? "fp32" : "bf16";
  const std::string trainer = f.pipeline ? "on a pipeline (--pp/--vpp)" : "without a pipeline (no --pp/--vpp)";
  const std::string switch_trainer =
      f.pipeline ? "one saved without --pp/--vpp (its LM head is wte.weight itself, no lm_head.weight) resumes only "
                   "without them"
                 : "one saved with --pp/--vpp (its LM head a separate lm_head.weight) resumes only with --pp (at any "
                   "size; --pp 1 runs every layer on one stage)";
  return "This run trains " + trainer + " with --dtype " + dtype + ": it resumes checkpoints of the same model saved " +
         trainer + " with --dtype " + dtype + " (at any --dp, --tp" + (f.pipeline ? ", --pp, --vpp" : "") + "); " +
         switch_trainer + ", and one saved with --dtype " + other + " only with --dtype " + other + ".";
}

// The ZeRO-1 optimizer's config (--distributed-optimizer), the same for the plain model and for each
// pipeline chunk: --optimizer sgd|adamw, or muon with the embeddings and the LM head (tied to wte) on
// AdamW; no weight decay.
inline meshddp::DistributedOptimizerConfig zero1_config(const Flags& f) {
  meshddp::DistributedOptimizerConfig oc;
  oc.kind = f.optimizer == "sgd" ? meshddp::OptimizerKind::kSgd : meshddp::OptimizerKind::kAdamW;
  if (f.optimizer == "muon") {
    oc.kind = meshddp::OptimizerKind::kMuon;
    oc.muon_adamw_params = "*wte*,*wpe*,*lm_head*";
  }
  oc.lr = f.run.lr;
  oc.weight_decay = 0.0;
  oc.clip_grad_norm = f.clip_grad;
  return oc;
}

}  // namespace gpt
