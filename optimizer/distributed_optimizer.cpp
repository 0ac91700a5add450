#include "optimizer/distributed_optimizer.h"

#include "common/grad_norm.h"
#include "grad_buffer/glob_match.h"
#include "grad_buffer/grad_buffer.h"
#include "grad_buffer/run_stats.h"
#include "mesh/collectives.h"
#include "optimizer/fused_step.h"
#include "optimizer/optimizer_config_fields.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <sstream>

namespace meshddp {
namespace {

// `grad` (bucket shard `shard`'s fp32 gradient) cut into the parts this rank counts toward the norm.
NormPieces shard_norm_pieces(const GradBuffer& buffer, const BucketShard& shard, const at::Tensor& grad) {
  std::vector<GradRun> runs;
  runs.reserve(shard.segments.size());
  for (const ShardSegment& seg : shard.segments)
    runs.push_back({seg.shard_offset, seg.numel, &buffer.placement(seg.param)});
  return norm_pieces(grad, runs, buffer.groups().tp_rank);
}

// Each element once over the whole run (Note [Gradient norm over DP x TP]): shards are disjoint within
// a bucket's group. With K optimizer instances a dense shard is held by K ranks (one per instance, equal
// after the all-reduce across instances): only instance 0's counts, for expert buckets as dense ones.
// A weight tied across pipeline stages: its two copies hold one summed gradient, counted on the first stage.
bool counts_toward_norm(const GradBuffer& buffer, const BucketShard& shard) {
  const BucketReduction& r = buffer.bucket_reduction(shard.bucket);
  if (r.tied_group && !buffer.groups().counts_tied()) return false;
  return !r.cross_group || buffer.groups().instance_index() == 0;
}

}  // namespace

std::string field_text(const std::vector<ParamGroupRule>& rules) {
  std::string out = "[";
  auto optional_text = [](const std::optional<double>& v) { return v ? field_text(*v) : std::string("default"); };
  for (size_t r = 0; r < rules.size(); ++r) {
    out += (r ? "; " : "") + rules[r].pattern + ": lr=" + optional_text(rules[r].lr) +
           " weight_decay=" + optional_text(rules[r].weight_decay);
  }
  return out + "]";
}

void DistributedOptimizerConfig::validate() const {
  validate_field_ranges(*this, kOptimizerConfigFields, "DistributedOptimizerConfig");
  for (const auto& rule : groups) {
    TORCH_CHECK(!rule.pattern.empty(), "DistributedOptimizerConfig: a group rule has an empty pattern");
    TORCH_CHECK(!rule.lr || *rule.lr > 0, "DistributedOptimizerConfig: group '", rule.pattern, "' has lr ", *rule.lr);
    TORCH_CHECK(!rule.weight_decay || *rule.weight_decay >= 0, "DistributedOptimizerConfig: group '", rule.pattern,
                "' has weight_decay ", *rule.weight_decay);
  }
}

DistributedOptimizer::DistributedOptimizer(GradBufferHandle buffer, DistributedOptimizerConfig config)
    : buffer_(buffer), config_(std::move(config)) {
  TORCH_CHECK(buffer_->config().use_distributed_optimizer,
              "DistributedOptimizer: the gradient buffer was built without use_distributed_optimizer; set it in the "
              "DdpConfig so buckets are padded and reduce-scattered and params live in the param buffer");
  // Every field, over the whole mesh (TP replicas of a param must take the same update too), then
  // validated (Note [Agree first, then validate], mesh/config_fields.h).
  verify_same_settings_across_ranks(buffer_->groups().stats_group(), field_settings(config_, kOptimizerConfigFields),
                                    "DistributedOptimizer", "the DistributedOptimizerConfig settings");
  config_.validate();
  param_buffer_ = buffer_->param_buffer();
  TORCH_INTERNAL_ASSERT(param_buffer_ != nullptr);
  // Each bucket sharded over its own group: DP for dense buckets (this rank's instance with K optimizer
  // instances: 1/(D/K)), expert-DP for expert ones (within the instance too: 1/(expert-DP/K)).
  std::vector<ShardOwner> owners;
  for (int64_t b = 0; b < static_cast<int64_t>(buffer_->layout().buckets.size()); ++b) {
    owners.push_back({buffer_->bucket_reduction(b).shard_rank, buffer_->bucket_reduction(b).shard_size});
  }
  shards_ = shard_buckets(buffer_->layout(), owners);

  // Param groups: the default, then one per rule. A param matches a rule by any of its names.
  lr_ = config_.lr;
  groups_.push_back({config_.lr, config_.weight_decay, 1.0, 1.0});
  for (const auto& rule : config_.groups) {
    const double lr = rule.lr.value_or(config_.lr), wd = rule.weight_decay.value_or(config_.weight_decay);
    const double wd_ratio = config_.weight_decay > 0 ? wd / config_.weight_decay : (wd == 0 ? 0.0 : std::nan(""));
    groups_.push_back({lr, wd, lr / config_.lr, wd_ratio});
  }
  const auto& params = buffer_->params();
  group_of_.assign(params.size(), 0);
  std::vector<bool> rule_used(config_.groups.size(), false);
  for (size_t i = 0; i < params.size(); ++i) {
    for (size_t r = 0; r < config_.groups.size(); ++r) {
      if (name_matches(config_.groups[r].pattern, params[i])) {
        group_of_[i] = static_cast<int64_t>(r) + 1;
        rule_used[r] = true;
        break;
      }
    }
  }
  for (size_t r = 0; r < config_.groups.size(); ++r) {
    TORCH_CHECK(rule_used[r], "DistributedOptimizer: group rule #", r, " with pattern '", config_.groups[r].pattern,
                "' matches no trainable parameter (", params.size(), " in all", params.empty() ? "" : ", e.g. '",
                params.empty() ? "" : params.front().name, params.empty() ? "" : "'",
                "; an earlier rule takes a param first); fix the pattern ('*' matches any run of characters) or drop ",
                "the rule");
  }

  // Muon: which params take it; each must be whole in one shard (the whole_param policy).
  takes_muon_.assign(params.size(), false);
  if (config_.kind == OptimizerKind::kMuon) choose_muon_params();
  const std::vector<bool>& takes_muon = takes_muon_;

  c10::NoGradGuard no_grad;
  const auto f32 = [](const at::Tensor& like) { return at::TensorOptions().dtype(at::kFloat).device(like.device()); };
  views_.resize(groups_.size());
  for (size_t b = 0; b < shards_.size(); ++b) {
    const BucketShard& shard = shards_[b];
    const at::Tensor params = param_shard(b);
    const bool fp32_params = params.scalar_type() == at::kFloat;
    master_is_param_view_.push_back(fp32_params);
    master_.push_back(fp32_params ? params : params.to(at::kFloat));
    at::Tensor grad_shard = buffer_->bucket_shard(shard.bucket);
    grad32_.push_back(grad_shard.scalar_type() == at::kFloat ? grad_shard : at::zeros({shard.numel}, f32(grad_shard)));
    const int64_t states = num_state_tensors();
    state1_.push_back(states >= 1 ? at::zeros({shard.numel}, f32(params)) : at::Tensor());
    // State 2 (AdamW's exp_avg_sq) is per shard for the fused kernels; under kMuon only the AdamW
    // segments have one, packed in segment order (a Muon matrix has its momentum buffer only: -1).
    const bool packed = config_.kind == OptimizerKind::kMuon;
    std::vector<int64_t>& offsets2 = state2_offsets_.emplace_back();
    int64_t state2_numel = packed ? 0 : shard.numel;
    for (const ShardSegment& seg : shard.segments) {
      if (!packed) {
        offsets2.push_back(seg.shard_offset);
      } else if (takes_muon[seg.param]) {
        offsets2.push_back(-1);
      } else {
        offsets2.push_back(state2_numel);
        state2_numel += seg.numel;
      }
    }
    state2_.push_back(states >= 2 ? at::zeros({state2_numel}, f32(params)) : at::Tensor());
    for (size_t si = 0; si < shard.segments.size(); ++si) {
      const ShardSegment& seg = shard.segments[si];
      if (takes_muon[seg.param]) {
        const NamedParam& named = buffer_->params()[seg.param];
        const at::Tensor& p = named.param;
        TORCH_INTERNAL_ASSERT(seg.param_offset == 0 && seg.numel == p.numel(), "Muon matrix '", named.name,
                              "' is not whole in DP rank's shard of bucket ", shard.bucket);
        // A TP-sharded matrix is orthogonalized whole (update_muon gathers it over TP), so the result
        // does not depend on the TP size; every TP rank owns the same pieces (same layout), in order.
        const Placement placement = buffer_->placement(static_cast<int64_t>(seg.param));
        const int64_t tp_dim = placement.is_shard() && buffer_->groups().tp_size > 1 ? placement.dim : -1;
        // A stack [E, m, n] (muon_stacked_matrices) is never TP-sharded (choose_muon_params refuses it).
        const int64_t stack = p.dim() == 3 ? p.size(0) : 1;
        muon_.push_back({b, seg, p.size(-2), p.size(-1), tp_dim, stack});
        continue;
      }
      SegmentViews& v = views_[group_of_[seg.param]];
      v.master.push_back(master_[b].narrow(0, seg.shard_offset, seg.numel));
      v.grad.push_back(grad32_[b].narrow(0, seg.shard_offset, seg.numel));
      if (states >= 1) v.state1.push_back(state1_[b].narrow(0, seg.shard_offset, seg.numel));
      if (states >= 2) v.state2.push_back(state2_[b].narrow(0, offsets2[si], seg.numel));
    }
  }
  params_version_seen_ = param_buffer_->params_version();

  // The fused kernels write fp32 and bf16 params; fp16 (or a build without CUDA kernels) keeps ATen.
  bool fusable = !master_.empty() && fused_kernels_available(master_.front().device());
  std::string why_not =
      master_.empty() ? "" : "no fused kernels for " + master_.front().device().str() + " in this build";
  for (size_t b = 0; b < shards_.size() && fusable; ++b) {
    const at::ScalarType t = param_shard(b).scalar_type();
    if (t != at::kFloat && t != at::kBFloat16) {
      fusable = false;
      why_not = std::string("bucket ") + std::to_string(shards_[b].bucket) + "'s params are " + c10::toString(t) +
                " (the fused kernels write fp32 or bf16)";
    }
  }
  TORCH_CHECK(config_.fused_step != FusedStep::kAlways || fusable || master_.empty(),
              "DistributedOptimizer: fused_step = kAlways, but ", why_not, "; use FusedStep::kAuto or kNever");
  TORCH_CHECK(config_.kind != OptimizerKind::kMuon || config_.fused_step != FusedStep::kAlways,
              "DistributedOptimizer: fused_step = kAlways, but kind = muon has no fused kernels yet (Newton-Schulz ",
              "runs as ATen matmuls); use FusedStep::kAuto or kNever");
  fused_ = config_.kind != OptimizerKind::kMuon && fusable &&
           (config_.fused_step == FusedStep::kAlways ||
            (config_.fused_step == FusedStep::kAuto && !master_.front().is_cpu()));
}

bool DistributedOptimizer::name_matches(const std::string& pattern, const NamedParam& p) {
  if (glob_match(pattern, p.name)) return true;
  for (const auto& alias : p.aliases) {
    if (glob_match(pattern, alias)) return true;
  }
  return false;
}

void DistributedOptimizer::check_group(int64_t group, const char* who) const {
  TORCH_CHECK(group >= 0 && group < num_groups(), "DistributedOptimizer::", who, ": group ", group,
              " does not exist; there are ", num_groups(), " (0 = the default, then one per ParamGroupRule)");
}

void DistributedOptimizer::set_lr(double lr) {
  TORCH_CHECK(lr >= 0 && std::isfinite(lr), "DistributedOptimizer::set_lr: lr must be finite and >= 0, got ", lr);
  lr_ = lr;
  for (Group& g : groups_) g.lr = lr * g.lr_ratio;
}

void DistributedOptimizer::set_weight_decay(double weight_decay) {
  TORCH_CHECK(weight_decay >= 0 && std::isfinite(weight_decay),
              "DistributedOptimizer::set_weight_decay: weight_decay must be finite and >= 0, got ", weight_decay);
  for (Group& g : groups_) {
    if (!std::isnan(g.wd_ratio)) g.weight_decay = weight_decay * g.wd_ratio;
  }
}

void DistributedOptimizer::set_group_lr(int64_t group, double lr) {
  check_group(group, "set_group_lr");
  TORCH_CHECK(lr >= 0 && std::isfinite(lr), "DistributedOptimizer::set_group_lr: group ", group,
              ": lr must be finite and >= 0, got ", lr);
  groups_[group].lr = lr;
}

void DistributedOptimizer::set_group_weight_decay(int64_t group, double weight_decay) {
  check_group(group, "set_group_weight_decay");
  TORCH_CHECK(weight_decay >= 0 && std::isfinite(weight_decay), "DistributedOptimizer::set_group_weight_decay: group ",
              group, ": weight_decay must be finite and >= 0, got ", weight_decay);
  groups_[group].weight_decay = weight_decay;
}

double DistributedOptimizer::group_lr(int64_t group) const {
  check_group(group, "group_lr");
  return groups_[group].lr;
}

double DistributedOptimizer::group_weight_decay(int64_t group) const {
  check_group(group, "group_weight_decay");
  return groups_[group].weight_decay;
}

int64_t DistributedOptimizer::num_state_tensors() const {
  // kMuon: the momentum buffer of a Muon matrix is state 1; state 2 is the AdamW params' only.
  if (config_.kind == OptimizerKind::kAdamW || config_.kind == OptimizerKind::kMuon) return 2;
  return config_.momentum > 0 ? 1 : 0;
}

void DistributedOptimizer::prepare_grads() {
  for (size_t b = 0; b < shards_.size(); ++b) {
    at::Tensor grad_shard = buffer_->bucket_shard(shards_[b].bucket);
    if (!grad_shard.is_same(grad32_[b]) && grad_shard.data_ptr() != grad32_[b].data_ptr()) grad32_[b].copy_(grad_shard);
  }
}

void DistributedOptimizer::reload_masters_from_params() {
  finish_param_sync();
  c10::NoGradGuard no_grad;
  for (size_t b = 0; b < shards_.size(); ++b) {
    if (master_is_param_view_[b]) continue;
    // Only where the param is no longer its master rounded to the param dtype: a param not written
    // (a partial load) or written with the value it had (a state_dict saved from this run, a load
    // around load_checkpoint) keeps its fp32 master, so a resume is bit-exact.
    const at::Tensor params = param_shard(b);
    const at::Tensor changed = master_[b].to(params.scalar_type()).ne(params);
    master_[b].copy_(at::where(changed, params.to(at::kFloat), master_[b]));
  }
  params_version_seen_ = param_buffer_->params_version();
}

at::Tensor DistributedOptimizer::local_stats() {
  buffer_.finish_grad_sync();
  finish_param_sync();
  if (param_buffer_->params_version() != params_version_seen_) reload_masters_from_params();
  c10::NoGradGuard no_grad;
  prepare_grads();

  // [non-finite values seen by this rank's local gradients, sum of squares of its reduced shards].
  const c10::Device device = master_.empty() ? c10::Device(c10::kCPU) : master_.front().device();
  at::Tensor stats = at::zeros({2}, at::TensorOptions().dtype(at::kDouble).device(device));
  stats[0] += buffer_->local_nonfinite_counts().sum().to(at::kDouble);
  // Each element once over the whole run: counts_toward_norm().
  if (fused_) add_stats_fused(stats);
  for (size_t b = 0; b < grad32_.size() && !fused_; ++b) {
    const at::Tensor& g = grad32_[b];
    const at::Tensor norm = at::linalg_vector_norm(g, 2);
    // Any NaN/Inf makes the norm non-finite, so on CPU (where isfinite's unfused passes cost ~120 ms
    // per 10M elements on one core; count_nonfinite_pieces in grad_buffer/nonfinite_count.h proves
    // the common case the same way, with one sum) the exact count runs only when the norm is not
    // finite. Same counts as counting always; on CUDA it stays lazy.
    if (!g.is_cpu() || !std::isfinite(norm.item<double>())) {
      stats[0] += at::isfinite(g).logical_not().sum().to(at::kDouble);
    }
    if (!counts_toward_norm(buffer_, shards_[b])) continue;
    const NormPieces pieces = shard_norm_pieces(buffer_, shards_[b], g);
    if (pieces.all_count) {
      stats[1] += norm.to(at::kDouble).square();
    } else {
      add_squared_norms(pieces.counted, stats[1]);
    }
  }
  return stats;
}

void DistributedOptimizer::apply_step(double grad_scale) {
  c10::NoGradGuard no_grad;
  if (grad_scale != 1.0 && !fused_) {
    for (auto& g : grad32_) g.mul_(grad_scale);
  }
  ++step_;
  if (fused_) {
    update_fused(grad_scale);
    param_buffer_->start_param_sync(/*async=*/config_.overlap_param_gather);
    return;
  }
  if (config_.kind == OptimizerKind::kAdamW) {
    update_adamw();
  } else if (config_.kind == OptimizerKind::kMuon) {
    update_adamw();  // the params not on Muon (views_ leaves the Muon matrices out)
    update_muon();
  } else {
    update_sgd();
  }
  write_params_and_gather();
}

StepResult DistributedOptimizer::step() { return step_together({this}); }

StepResult DistributedOptimizer::step_together(const std::vector<DistributedOptimizer*>& chunks) {
  check_chunks(chunks);
  const DistributedOptimizer& first = *chunks.front();
  const SyncGroups& groups = first.buffer_->groups();
  const auto n = static_cast<double>(chunks.size());
  // [non-finite count, sum of squares] of every chunk, then [chunks, chunks^2, clip, clip^2]: the ranks'
  // chunk counts and clip_grad_norm checked equal in the same all-reduce (a rank stepping fewer chunks
  // would pair the reports wrongly; another stage's bound would clip it by another coefficient).
  at::Tensor stats;
  for (DistributedOptimizer* chunk : chunks) {
    at::Tensor local = chunk->local_stats();
    stats = stats.defined() ? stats + local.to(stats.device()) : local;
  }
  const double clip = first.config_.clip_grad_norm;
  stats =
      at::cat({stats, at::tensor({n, n * n, clip, clip * clip}, stats.options().device(c10::kCPU)).to(stats.device())});
  // `stats` lives until after the wait and the read (Note [Stream lifetimes of collective temporaries]).
  all_reduce_over_run(groups, stats, "the optimizer's gradient checks (non-finite count, norm)");
  const at::Tensor host = stats.cpu();
  TORCH_CHECK(same_on_every_rank(host[2].item<double>(), host[3].item<double>(), ranks_in_run(groups)),
              "DistributedOptimizer::step_together: the ranks of the run stepped different numbers of model chunks ",
              "(this rank ", chunks.size(), ", ", describe_rank(groups), ")); every rank steps every chunk it holds ",
              "in one call, and every stage holds the same number of chunks. Nothing was updated");
  TORCH_CHECK(same_on_every_rank(host[4].item<double>(), host[5].item<double>(), ranks_in_run(groups)),
              "DistributedOptimizer::step_together: clip_grad_norm differs across the ranks of the run (this rank ",
              clip, ", ", describe_rank(groups), "); the mean over every rank is ",
              host[4].item<double>() / static_cast<double>(ranks_in_run(groups)),
              ". One run clips by one bound: give every stage's optimizers the same ",
              "DistributedOptimizerConfig::clip_grad_norm. Nothing was updated");
  StepResult result;
  result.grad_norm = std::sqrt(host[1].item<double>());
  if (host[0].item<double>() > 0) {
    result.skipped = true;
    result.grad_norm = std::numeric_limits<double>::quiet_NaN();
    result.report = "DistributedOptimizer: step skipped, non-finite gradients (parameters unchanged on every rank";
    result.report += groups.has_pipeline() ? " of every pipeline stage):\n" : "):\n";
    for (DistributedOptimizer* chunk : chunks) result.report += chunk->nonfinite_report();
    return result;
  }
  double grad_scale = 1.0;
  if (clip > 0) {
    const double coef = clip / (result.grad_norm + 1e-6);
    if (coef < 1.0) {
      grad_scale = coef;
      result.clipped = true;
    }
  }
  for (DistributedOptimizer* chunk : chunks) chunk->apply_step(grad_scale);
  return result;
}

void DistributedOptimizer::check_chunks(const std::vector<DistributedOptimizer*>& chunks) {
  TORCH_CHECK(!chunks.empty(), "DistributedOptimizer::step_together: no optimizers given; pass every model chunk's");
  for (size_t c = 0; c < chunks.size(); ++c) {
    TORCH_CHECK(chunks[c] != nullptr, "DistributedOptimizer::step_together: chunk ", c, "'s optimizer is null");
    for (size_t d = 0; d < c; ++d) {
      TORCH_CHECK(chunks[d] != chunks[c], "DistributedOptimizer::step_together: chunk ", c, "'s optimizer is chunk ", d,
                  "'s too; pass each model chunk's optimizer once");
    }
    const SyncGroups& g = chunks[c]->buffer_->groups();
    const SyncGroups& g0 = chunks.front()->buffer_->groups();
    const auto where = [](const SyncGroups& x) {
      return std::vector<int64_t>{x.stats_group().getRank(), x.stats_group().getSize(),
                                  x.has_pipeline() ? x.pipeline->getRank() : -1,
                                  x.has_pipeline() ? x.pipeline->getSize() : 1};
    };
    TORCH_CHECK(where(g) == where(g0), "DistributedOptimizer::step_together: chunk ", c,
                " is synced over other groups than chunk 0; the ",
                "chunks stepped together must be wrapped over the same mesh");
    TORCH_CHECK(chunks[c]->config_.clip_grad_norm == chunks.front()->config_.clip_grad_norm,
                "DistributedOptimizer::step_together: chunk ", c, " clips at ", chunks[c]->config_.clip_grad_norm,
                " but chunk 0 at ", chunks.front()->config_.clip_grad_norm,
                " (DistributedOptimizerConfig::clip_grad_norm); the chunks of one run clip by one norm to one bound");
  }
  std::vector<const void*> buffers;
  for (const DistributedOptimizer* chunk : chunks) buffers.push_back(&*chunk->buffer_);
  check_every_chunk_given(chunks.front()->buffer_->groups(), buffers, "DistributedOptimizer::step",
                          "Step every chunk's optimizer in one call: "
                          "DistributedOptimizer::step_together({&chunk0_optimizer, &chunk1_optimizer, ...}) "
                          "(Python: meshddp.DistributedOptimizer.step_together([...]))");
}

void DistributedOptimizer::update_adamw() {
  const double b1 = config_.beta1, b2 = config_.beta2;
  const double bias_correction1 = 1 - std::pow(b1, static_cast<double>(step_));
  const double bias_correction2 = 1 - std::pow(b2, static_cast<double>(step_));
  for (size_t g = 0; g < groups_.size(); ++g) {
    SegmentViews& v = views_[g];
    if (v.master.empty()) continue;
    const double lr = groups_[g].lr;
    // Same sequence as torch::optim::AdamW::step (elementwise, so bit-identical per element).
    at::_foreach_mul_(v.master, 1 - lr * groups_[g].weight_decay);
    at::_foreach_mul_(v.state1, b1);
    at::_foreach_add_(v.state1, v.grad, 1 - b1);
    at::_foreach_mul_(v.state2, b2);
    at::_foreach_addcmul_(v.state2, v.grad, v.grad, 1 - b2);
    auto denom = at::_foreach_sqrt(v.state2);
    at::_foreach_div_(denom, std::sqrt(bias_correction2));
    at::_foreach_add_(denom, config_.eps);
    at::_foreach_addcdiv_(v.master, v.state1, denom, -lr / bias_correction1);
  }
}

void DistributedOptimizer::update_sgd() {
  for (size_t g = 0; g < groups_.size(); ++g) {
    SegmentViews& v = views_[g];
    if (v.master.empty()) continue;
    // Same sequence as torch::optim::SGD::step (dampening 0, no Nesterov).
    std::vector<at::Tensor> d = v.grad;
    if (groups_[g].weight_decay != 0) d = at::_foreach_add(v.grad, v.master, groups_[g].weight_decay);
    if (config_.momentum > 0) {
      at::_foreach_mul_(v.state1, config_.momentum);  // zero-initialised: step 1 gives buf = d exactly
      at::_foreach_add_(v.state1, d, 1.0);
      d = v.state1;
    }
    at::_foreach_add_(v.master, d, -1 * groups_[g].lr);
  }
}

void DistributedOptimizer::add_stats_fused(const at::Tensor& stats) {
  // fused_grad_stats gives [sum of squares of finite elements, non-finite count]; elements that do
  // not count on this TP rank (Note [Gradient norm over DP x TP]) go into a second accumulator for
  // their count only.
  const auto f64 = stats.options();
  const at::Tensor counted = at::zeros({2}, f64), others = at::zeros({2}, f64);
  for (size_t b = 0; b < grad32_.size(); ++b) {
    const NormPieces pieces = shard_norm_pieces(buffer_, shards_[b], grad32_[b]);
    const bool counts = counts_toward_norm(buffer_, shards_[b]);
    for (const at::Tensor& piece : pieces.counted) fused_grad_stats(piece, counts ? counted : others);
    for (const at::Tensor& piece : pieces.not_counted) fused_grad_stats(piece, others);
  }
  stats[0] += counted[1] + others[1];
  stats[1] += counted[0];
}

void DistributedOptimizer::update_fused(double grad_scale) {
  // One kernel per run of adjacent segments of one param group (padding between buckets' params
  // is never touched, as with the foreach path).
  const bool adamw = config_.kind == OptimizerKind::kAdamW;
  for (size_t b = 0; b < shards_.size(); ++b) {
    const auto& segs = shards_[b].segments;
    const at::Tensor param = master_is_param_view_[b] ? at::Tensor() : param_shard(b);
    for (size_t first = 0; first < segs.size();) {
      const int64_t group = group_of_[segs[first].param];
      size_t last = first + 1;
      while (last < segs.size() && group_of_[segs[last].param] == group &&
             segs[last].shard_offset == segs[last - 1].shard_offset + segs[last - 1].numel) {
        ++last;
      }
      const int64_t offset = segs[first].shard_offset;
      const int64_t numel = segs[last - 1].shard_offset + segs[last - 1].numel - offset;
      auto part = [&](const at::Tensor& t) { return t.defined() ? t.narrow(0, offset, numel) : at::Tensor(); };
      const Group& g = groups_[group];
      if (adamw) {
        fused_adamw_step(
            part(grad32_[b]), part(state1_[b]), part(state2_[b]), part(master_[b]), part(param),
            adamw_scalars(g.lr, g.weight_decay, config_.beta1, config_.beta2, config_.eps, step_, grad_scale));
      } else {
        fused_sgd_step(part(grad32_[b]), part(state1_[b]), part(master_[b]), part(param),
                       sgd_scalars(g.lr, g.weight_decay, config_.momentum, grad_scale));
      }
      first = last;
    }
  }
}

at::Tensor DistributedOptimizer::param_shard(size_t b) const {
  const BucketShard& shard = shards_[b];
  const int64_t offset = shard.begin - buffer_->layout().buckets[shard.bucket].begin;
  if (const ShardedParams* sharded = param_buffer_->sharded()) {  // "optim_grads_params": the kept shard
    const at::Tensor& kept = sharded->bucket_shard(shard.bucket);
    TORCH_INTERNAL_ASSERT(
        kept.numel() == shard.numel && offset == kept.numel() * buffer_->bucket_reduction(shard.bucket).shard_rank,
        "DistributedOptimizer: bucket ", shard.bucket, "'s shard is not the sharded params' one");
    return kept;
  }
  return param_buffer_->bucket_data(shard.bucket).narrow(0, offset, shard.numel);
}

void DistributedOptimizer::write_masters_into_param_buffer() {
  for (size_t b = 0; b < shards_.size(); ++b) {
    if (!master_is_param_view_[b]) param_shard(b).copy_(master_[b]);
  }
}

void DistributedOptimizer::write_params_and_gather() {
  write_masters_into_param_buffer();
  param_buffer_->start_param_sync(/*async=*/config_.overlap_param_gather);
}

void DistributedOptimizer::finish_param_sync() { param_buffer_->finish_param_sync(); }

std::string DistributedOptimizer::nonfinite_report() {
  // Local: which params had non-finite values before the reduction (this rank produced them), and
  // which owned params have non-finite reduced gradients.
  const auto& params = buffer_->params();
  std::ostringstream mine;
  const std::vector<int64_t> produced = buffer_->local_nonfinite_counts_by_param();
  for (int64_t b = 0; b < static_cast<int64_t>(buffer_->layout().buckets.size()); ++b) {
    for (int64_t p : buffer_->layout().buckets[b].params) {
      if (produced[p] == 0) continue;
      mine << "  DP rank " << buffer_->groups().data_parallel_rank() << " produced " << produced[p]
           << " non-finite value(s) in its local "
           << "gradient of parameter '" << params[p].name << "' (" << params[p].param.numel() << " elements, bucket "
           << b << ")\n";
    }
  }
  for (size_t b = 0; b < shards_.size(); ++b) {
    for (const ShardSegment& seg : shards_[b].segments) {
      if (at::isfinite(grad32_[b].narrow(0, seg.shard_offset, seg.numel)).all().item<bool>()) continue;
      const BucketReduction& r = buffer_->bucket_reduction(shards_[b].bucket);
      mine << "  parameter '" << params[seg.param].name << "' has a non-finite reduced gradient in elements ["
           << seg.param_offset << ", " << seg.param_offset + seg.numel << ") ("
           << (r.expert ? "expert-DP rank " + std::to_string(r.shard_rank)
                        : "DP rank " + std::to_string(buffer_->groups().data_parallel_rank()))
           << "'s shard)\n";
    }
  }
  // Gather every rank's lines so every rank reports the same: over the DP group, i.e. within the
  // instance, then (K optimizer instances) the instances' texts across them.
  std::string lines;
  for (const std::string& part : all_gather_strings(*buffer_->groups().dp, mine.str(), "the non-finite report"))
    lines += part;
  if (const auto& cross = buffer_->groups().cross_instance) {
    std::string all;
    for (const std::string& part : all_gather_strings(*cross, lines, "the non-finite report across instances"))
      all += part;
    lines = std::move(all);
  }
  // Every stage's lines, each under its stage, on every stage.
  const SyncGroups& groups = buffer_->groups();
  if (groups.has_pipeline()) {
    const std::string mine_with_stage = lines.empty() ? "" : " " + describe_stage(groups) + "model chunk:\n" + lines;
    std::string all;
    for (const std::string& part : all_gather_strings(*groups.pipeline, mine_with_stage, "the non-finite report"))
      all += part;
    lines = std::move(all);
  }
  return lines;
}

std::vector<std::string> DistributedOptimizer::muon_params() const {
  std::vector<std::string> out;
  for (size_t i = 0; i < takes_muon_.size(); ++i) {
    if (takes_muon_[i]) out.push_back(buffer_->params()[i].name);
  }
  return out;
}

MemoryReport DistributedOptimizer::memory() const {
  MemoryReport m;
  m.param_buffer_bytes = param_buffer_->bytes();
  m.grad_buffer_bytes = buffer_->grad_buffer_bytes();
  for (size_t b = 0; b < shards_.size(); ++b) {
    if (!master_is_param_view_[b]) m.master_weight_bytes += master_[b].nbytes();
    if (state1_[b].defined()) m.optimizer_state_bytes += state1_[b].nbytes();
    if (state2_[b].defined()) m.optimizer_state_bytes += state2_[b].nbytes();
    if (grad32_[b].data_ptr() != buffer_->bucket_shard(shards_[b].bucket).data_ptr())
      m.grad_scratch_bytes += grad32_[b].nbytes();
  }
  return m;
}

}  // namespace meshddp
