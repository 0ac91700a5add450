// The one list of DistributedOptimizerConfig's fields, in declaration order, with each numeric
// field's allowed range. It drives DistributedOptimizerConfig::validate(), the cross-rank agreement
// of the settings when a DistributedOptimizer is built, and the Python package's OptimizerConfig
// keywords, properties and __repr__ (plugin/python). A new field must be added here: the
// static_assert below says so. Also the text of the enum and group-rule fields.
#pragma once

#include "../mesh/config_fields.h"
#include "distributed_optimizer.h"

#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace meshddp {

inline constexpr std::pair<OptimizerKind, const char*> kOptimizerKindNames[] = {
    {OptimizerKind::kAdamW, "adamw"}, {OptimizerKind::kSgd, "sgd"}, {OptimizerKind::kMuon, "muon"}};
inline constexpr std::pair<NsCoefficients, const char*> kNsCoefficientsNames[] = {
    {NsCoefficients::kTorch, "torch"}, {NsCoefficients::kQuintic, "quintic"}};
inline constexpr std::pair<NsDtype, const char*> kNsDtypeNames[] = {{NsDtype::kBFloat16, "bf16"},
                                                                    {NsDtype::kFloat32, "fp32"}};
inline constexpr std::pair<MuonScale, const char*> kMuonScaleNames[] = {{MuonScale::kOriginal, "original"},
                                                                        {MuonScale::kMatchRmsAdamW, "match_rms_adamw"},
                                                                        {MuonScale::kSpectral, "spectral"}};
inline constexpr std::pair<FusedStep, const char*> kFusedStepNames[] = {
    {FusedStep::kAuto, "auto"}, {FusedStep::kAlways, "always"}, {FusedStep::kNever, "never"}};
inline std::span<const std::pair<OptimizerKind, const char*>> enum_names(OptimizerKind) { return kOptimizerKindNames; }
inline std::span<const std::pair<FusedStep, const char*>> enum_names(FusedStep) { return kFusedStepNames; }
inline std::span<const std::pair<NsCoefficients, const char*>> enum_names(NsCoefficients) {
  return kNsCoefficientsNames;
}
inline std::span<const std::pair<NsDtype, const char*>> enum_names(NsDtype) { return kNsDtypeNames; }
inline std::span<const std::pair<MuonScale, const char*>> enum_names(MuonScale) { return kMuonScaleNames; }

// "adamw", "never", ...: an enum field's text (settings, messages, Python).
template <typename E, std::enable_if_t<std::is_enum_v<E>, int> = 0>
std::string field_text(E value) {
  for (const auto& [v, name] : enum_names(E{})) {
    if (v == value) return name;
  }
  TORCH_INTERNAL_ASSERT(false, "an enum value without a name in optimizer_config_fields.h");
}

// The enum value named `text`; an error naming `field` and the accepted names otherwise.
template <typename E>
E enum_from_text(const std::string& text, const char* type, const char* field) {
  std::string names;
  for (const auto& [v, name] : enum_names(E{})) {
    if (text == name) return v;
    names += (names.empty() ? "'" : ", '") + std::string(name) + "'";
  }
  TORCH_CHECK(false, type, ": ", field, " must be one of ", names, ", got '", text, "'");
}

// "[*.bias: lr=default weight_decay=0; *norm*: lr=0.01 weight_decay=default]", one line.
std::string field_text(const std::vector<ParamGroupRule>& rules);

inline constexpr auto kOptimizerConfigFields = std::make_tuple(
    field("kind", &DistributedOptimizerConfig::kind),
    field("lr", &DistributedOptimizerConfig::lr, FieldRange{0.0, true, std::numeric_limits<double>::infinity(), true}),
    field("weight_decay", &DistributedOptimizerConfig::weight_decay, kNonNegative),
    field("beta1", &DistributedOptimizerConfig::beta1, FieldRange{0.0, false, 1.0, true}),
    field("beta2", &DistributedOptimizerConfig::beta2, FieldRange{0.0, false, 1.0, true}),
    field("eps", &DistributedOptimizerConfig::eps, kPositive),
    field("momentum", &DistributedOptimizerConfig::momentum, kNonNegative),
    field("groups", &DistributedOptimizerConfig::groups),  // each rule checked by validate()
    field("clip_grad_norm", &DistributedOptimizerConfig::clip_grad_norm, kNonNegative),  // 0 = off
    field("overlap_param_gather", &DistributedOptimizerConfig::overlap_param_gather),
    field("fused_step", &DistributedOptimizerConfig::fused_step),
    field("muon_momentum", &DistributedOptimizerConfig::muon_momentum, FieldRange{0.0, false, 1.0, true}),
    field("muon_nesterov", &DistributedOptimizerConfig::muon_nesterov),
    field("muon_ns_steps", &DistributedOptimizerConfig::muon_ns_steps, FieldRange{1.0, false, 100.0, true}),
    field("muon_ns_coefficients", &DistributedOptimizerConfig::muon_ns_coefficients),
    field("muon_ns_dtype", &DistributedOptimizerConfig::muon_ns_dtype),
    field("muon_scale", &DistributedOptimizerConfig::muon_scale),
    field("muon_extra_scale", &DistributedOptimizerConfig::muon_extra_scale, kPositive),
    field("muon_eps", &DistributedOptimizerConfig::muon_eps, kPositive),
    field("muon_adamw_params", &DistributedOptimizerConfig::muon_adamw_params),
    field("muon_stacked_matrices", &DistributedOptimizerConfig::muon_stacked_matrices));

static_assert(std::tuple_size_v<decltype(kOptimizerConfigFields)> ==
                  aggregate_field_count<DistributedOptimizerConfig>(),
              "a field of DistributedOptimizerConfig is missing from kOptimizerConfigFields "
              "(optimizer/optimizer_config_fields.h): add it there so it is validated, agreed across ranks, settable "
              "from Python and shown by repr");

}  // namespace meshddp
