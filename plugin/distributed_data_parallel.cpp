#include "plugin/distributed_data_parallel.h"

#include "grad_buffer/grad_buffer.h"
#include "grad_buffer/param_buffer.h"
#include "grad_buffer/param_gather.h"
#include "grad_buffer/run_stats.h"
#include "grad_buffer/sharded_params.h"
#include "mesh/collectives.h"
#include "mesh/pipeline_groups.h"
#include "mesh/placement.h"
#include "mesh/process_group_factory.h"
#include "mesh/reduction_groups.h"
#include "plugin/ddp_config_fields.h"
#include "plugin/model_sync.h"
#include "plugin/module_ownership.h"
#include "plugin/tp_dim.h"

#include <ATen/ops/full.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <optional>
#include <sstream>
#include <tuple>
#include <unordered_map>

namespace meshddp {
namespace {

// Every setting the gradient sync depends on, which must be the same on every rank: every config
// field (kDdpConfigFields), then the group sizes.
std::vector<Setting> config_settings(const DdpConfig& c, const SyncGroups& g, bool has_experts) {
  std::vector<Setting> out = field_settings(c, kDdpConfigFields);
  out.push_back({"DP size", std::to_string(g.dp ? g.dp->getSize() : 0)});
  out.push_back({"TP size", std::to_string(g.tp_size)});
  out.push_back({"optimizer instances", std::to_string(g.instances())});
  out.push_back({"expert params", has_experts ? "some" : "none"});  // decides whether the expert-DP group is made
  return out;
}

// Whether any param (frozen ones too: they differ across EP ranks all the same) is an expert param
// (mesh/placement.h).
bool has_expert_params(const std::vector<NamedTensor>& params) {
  return std::any_of(params.begin(), params.end(),
                     [](const NamedTensor& p) { return p.tensor.defined() && is_expert_param(p.tensor); });
}

// Checks that expert params are named apart across EP ranks: each expert name must be held by exactly
// the ranks of one expert-DP group (expert_dp_size of the DP ranks). Experts named locally (every EP
// rank's first expert "experts.0...") would be saved to one checkpoint key from several EP ranks.
void verify_expert_names_are_global(c10d::ProcessGroup& dp_group, const std::vector<NamedTensor>& experts,
                                    int64_t expert_dp_size, int64_t ep) {
  std::string mine;
  for (const auto& p : experts) mine += p.name + "\n";
  std::map<std::string, int64_t> holders;
  for (const std::string& text : all_gather_strings(dp_group, mine, "the expert name check")) {
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);) ++holders[line];
  }
  for (const auto& [name, count] : holders) {
    TORCH_CHECK(count == expert_dp_size, "DistributedDataParallel: expert parameter '", name, "' is held by ", count,
                " of the ", dp_group.getSize(), " data-parallel ranks, but an expert lives on the ", expert_dp_size,
                " ranks of one expert-data-parallel group (DP size ", dp_group.getSize(), " / expert_parallel_size ",
                ep, "). Name experts by their global index (e.g. 'experts.<e>.fc1.weight' with e counted over all ",
                "EP ranks), so that each EP rank's experts have names of their own (checkpoints key them by name)");
  }
}

// Leads the model-mismatch error when expert parallel is on but nothing was declared an expert: the
// EP ranks' different experts then look like different models.
std::string no_expert_hint(int64_t ep, bool has_experts) {
  if (ep == 1 || has_experts) return "";
  return "DistributedDataParallel: DdpConfig::expert_parallel_size = " + std::to_string(ep) +
         " but no parameter was declared an expert, so the experts each EP rank holds are checked (and would be "
         "averaged) over the whole data-parallel group. Declare every expert param before wrapping the model: the "
         "plan style ExpertParallel (e.g. {\"blocks.*.moe.experts\", meshddp::ExpertParallel{}}) or "
         "meshddp::declare_expert_param(param); or set expert_parallel_size = 1 if the model has no experts. ";
}

// Splits `params` into dense and expert ones.
std::pair<std::vector<NamedTensor>, std::vector<NamedTensor>> split_experts(const std::vector<NamedTensor>& params) {
  std::pair<std::vector<NamedTensor>, std::vector<NamedTensor>> out;
  for (const auto& p : params) (is_expert_param(p.tensor) ? out.second : out.first).push_back(p);
  return out;
}

// Which buckets a layout agreement covers: those of one group (the DP group compares the dense
// buckets, each expert-DP group its expert buckets: different EP ranks hold different experts), or
// the TP-partial ones (all-reduced over the whole mesh, so they must agree across TP ranks too).
enum class LayoutPart { kDense, kExpert, kTpPartial };

// The bucket layout as settings: bucket count, then per bucket (launch order) of `part` its size,
// dtype, collective and first param.
std::vector<Setting> layout_settings(const GradBuffer& buffer, LayoutPart part) {
  const BucketLayout& layout = buffer.layout();
  std::vector<Setting> out;
  int64_t count = 0;
  for (size_t b = 0; b < layout.buckets.size(); ++b) {
    const BucketSpan& span = layout.buckets[b];
    const BufferKey& key = layout.buffers[span.buffer].key;
    const bool in_part = part == LayoutPart::kTpPartial ? key.tp_partial : key.expert == (part == LayoutPart::kExpert);
    if (!in_part) continue;
    ++count;
    std::ostringstream v;
    v << span.numel() << " x " << key.grad_dtype << ", "
      << (key.tp_partial                              ? "all-reduce over the mesh"
          : buffer.config().use_distributed_optimizer ? "reduce-scatter"
                                                      : "all-reduce")
      << (key.expert ? " over expert-DP" : "") << ", first param '" << buffer.params()[span.params.front()].name << "'";
    out.push_back({"bucket " + std::to_string(b), v.str()});
  }
  const char* what = part == LayoutPart::kTpPartial ? "TP-partial bucket count"
                     : part == LayoutPart::kExpert  ? "expert bucket count"
                                                    : "bucket count";
  out.insert(out.begin(), Setting{what, std::to_string(count)});
  return out;
}

// The group gradients are averaged over: one dim's group (mesh[dim] names an unknown dim, as
// always), or the flattened group of several (DP x CP), checked first by tp_dim_of so that an unknown
// or extra dim is named as DDP's.
c10::intrusive_ptr<c10d::ProcessGroup> dp_group_over(const DeviceMesh& mesh, const std::vector<std::string>& dp_dims) {
  if (dp_dims.size() == 1) return mesh[dp_dims.front()];
  const StageDims stage = stage_dims(mesh);  // a pipeline dim is neither DP nor TP
  (void)tp_dim_of(stage.names, stage.sizes, dp_dims);
  return mesh.flattened(dp_dims);
}

// Hierarchical ZeRO-1 (num_distributed_optimizer_instances = K > 1): `groups.dp` becomes this rank's
// optimizer instance, the block of D/K consecutive ranks of its DP (x CP) group, and
// `groups.cross_instance` the ranks at its position in every instance (Note [Hierarchical ZeRO-1],
// grad_buffer/bucket_sync.cpp). Collective over the mesh: every rank makes both groups.
void use_optimizer_instances(const DeviceMesh& mesh, const std::vector<std::string>& dp_dims, const DdpConfig& config,
                             SyncGroups& groups) {
  const int64_t k = config.num_distributed_optimizer_instances;
  // Every field (K among them) agrees on every rank before any rank makes the instance groups, or
  // validates: a rank with K = 1 would skip their rendezvous (and a rank with another K ask for other
  // groups), and a value invalid on one rank only would fail that rank alone, leaving the others to
  // wait (Note [Agree first, then validate], mesh/config_fields.h). init()'s check comes too late.
  c10d::ProcessGroup& agreement = groups.world ? *groups.world : *groups.dp;
  ensure_cpu_backend(agreement, "DistributedDataParallel");
  verify_same_settings_across_ranks(agreement, field_settings(config, kDdpConfigFields), "DistributedDataParallel",
                                    "the DdpConfig settings");
  config.validate();  // K >= 1 with the distributed optimizer, before any group is made
  config.check_combination();
  if (k == 1) return;
  const std::string name = flattened_dims_name(dp_dims);
  const RankGroups dp_groups = flattened_groups(mesh.sizes(), mesh.names(), dp_dims);
  const auto d = static_cast<int64_t>(dp_groups.front().size());
  TORCH_CHECK(d % k == 0, "DistributedDataParallel: num_distributed_optimizer_instances = ", k,
              " does not divide the data-parallel size ", d, " (the '", name, "' group of ", mesh.describe(),
              "); each instance holds D/K ranks, so choose a divisor of ", d,
              " (e.g. D / ranks per node, so that an instance is one node), or 1 for flat ZeRO-1");
  groups.dp = mesh.group_of(name + "/optimizer_instance", optimizer_instance_groups(dp_groups, k, name));
  groups.cross_instance = mesh.group_of(name + "/cross_instance", cross_instance_groups(dp_groups, k, name));
}

// Hierarchical ZeRO-1 with expert params: expert buckets are sharded within the optimizer instance
// too (Megatron-core's intra-instance expert-DP group), over `groups.expert_instance`, the expert-DP
// ranks of this rank's instance; their shards are then all-reduced over groups.cross_instance, whose K
// ranks hold the same experts (Note [Hierarchical ZeRO-1], grad_buffer/bucket_sync.cpp). Called by
// every rank with the same (agreed) settings, so every rank refuses alike or makes the same groups.
void use_expert_optimizer_instances(const DeviceMesh& mesh, const RankGroups& expert_groups, const std::string& name,
                                    const DdpConfig& config, SyncGroups& groups) {
  const int64_t k = config.num_distributed_optimizer_instances;
  if (k == 1) return;
  const auto size = static_cast<int64_t>(expert_groups.front().size());
  TORCH_CHECK(size % k == 0, "DistributedDataParallel: num_distributed_optimizer_instances = ", k,
              " does not divide the expert-data-parallel size ", size,
              " (data-parallel size / expert_parallel_size = ", config.expert_parallel_size, "; rank ", mesh.rank(),
              " of ", mesh.describe(),
              "); expert buckets are sharded within each instance, so choose a K that divides ", size,
              ", or a smaller expert_parallel_size");
  groups.expert_instance =
      mesh.group_of(name + "/optimizer_instance", optimizer_instance_groups(expert_groups, k, name));
  ensure_cpu_backend(*groups.expert_instance, "DistributedDataParallel");
}

}  // namespace

std::string tp_dim_of(const std::vector<std::string>& dim_names, const std::vector<int64_t>& dim_sizes,
                      const std::string& dp_dim) {
  return tp_dim_of(dim_names, dim_sizes, std::vector<std::string>{dp_dim});
}

std::string tp_dim_of(const std::vector<std::string>& dim_names, const std::vector<int64_t>& dim_sizes,
                      const std::vector<std::string>& dp_dims) {
  TORCH_INTERNAL_ASSERT(dim_names.size() == dim_sizes.size());
  TORCH_CHECK(!dp_dims.empty(),
              "DistributedDataParallel: no DP dim given; name the dim(s) gradients are averaged over");
  std::string all, dp_list;
  for (size_t d = 0; d < dim_names.size(); ++d)
    all += (d ? ", " : "") + dim_names[d] + "=" + std::to_string(dim_sizes[d]);
  for (size_t d = 0; d < dp_dims.size(); ++d) dp_list += (d ? "', '" : "") + dp_dims[d];
  const std::string what = dp_dims.size() == 1 ? "the DP dim" : "one of the DP dims '" + dp_list + "'";
  for (const auto& dp_dim : dp_dims) {
    TORCH_CHECK(std::find(dim_names.begin(), dim_names.end(), dp_dim) != dim_names.end(),
                "DistributedDataParallel: the mesh (", all, ") has no dim named '", dp_dim, "' (", what, ")");
  }
  const auto is_dp = [&](const std::string& name) {
    return std::find(dp_dims.begin(), dp_dims.end(), name) != dp_dims.end();
  };
  std::vector<std::string> others;
  for (size_t d = 0; d < dim_names.size(); ++d) {
    if (!is_dp(dim_names[d]) && dim_sizes[d] > 1) others.push_back(dim_names[d]);
  }
  TORCH_CHECK(others.size() <= 1, "DistributedDataParallel: the mesh (", all, ") has ", others.size(), " dims besides ",
              dp_dims.size() == 1 ? "the DP dim '" : "the DP dims '", dp_list,
              "' with more than one rank; meshddp syncs over a ",
              dp_dims.size() == 1 ? "DP x TP mesh, " : "(DP dims) x TP mesh, ",
              "so give it one with a single model-parallel dim (or sub-groups built for DP x TP)");
  return others.empty() ? "" : others.front();
}

void DdpConfig::validate() const {
  GradBufferConfig::validate();
  validate_field_ranges(*this, kDdpConfigFields, "DdpConfig");
}

DdpEngine::DdpEngine(std::shared_ptr<torch::nn::Module> module, const DeviceMesh& mesh, const std::string& dp_dim,
                     DdpConfig config)
    : DdpEngine(std::move(module), mesh, std::vector<std::string>{dp_dim}, config) {}

DdpEngine::DdpEngine(std::shared_ptr<torch::nn::Module> module, const DeviceMesh& mesh,
                     const std::vector<std::string>& dp_dims, DdpConfig config)
    : dp_group_(dp_group_over(mesh, dp_dims)), config_(config) {
  groups_.dp = dp_group_;
  // On a pipeline mesh each stage syncs within itself: its world leaves out the pp dim, which is not
  // TP either; the embedding group sums weights tied across stages (plugin/pipeline.cpp).
  verify_pipeline_settings(mesh, config_);
  groups_.world = stage_world(mesh);
  const StageDims stage = stage_dims(mesh);
  if (stage.names.size() < mesh.names().size()) {
    groups_.embedding = embedding_group(mesh);
    groups_.pipeline = mesh[kPipelineDim];  // gradient norms and non-finite checks span every stage
  }
  use_optimizer_instances(mesh, dp_dims, config_, groups_);
  if (const std::string tp_dim = tp_dim_of(stage.names, stage.sizes, dp_dims); !tp_dim.empty()) {
    groups_.tp = mesh[tp_dim];
    groups_.tp_rank = mesh.coordinate(tp_dim);
    groups_.tp_size = mesh.size(tp_dim);
  }
  const std::vector<std::string> dims = dp_dims;
  init(module, mesh.flattened_ranks(dp_dims), groups_.world ? *groups_.world : *dp_group_, [this, &mesh, dims] {
    const int64_t ep = config_.expert_parallel_size;
    // Named by its dims and EP size: DDPs with other settings on the same mesh get groups of their own.
    const std::string name = "expert_dp." + flattened_dims_name(dims) + ".ep" + std::to_string(ep);
    if (ep == 1) {  // every DP rank holds every expert: expert buckets are sharded as dense ones
      if (groups_.cross_instance) groups_.expert_instance = groups_.dp;
      return ExpertGroup{dp_group_, mesh.flattened_ranks(dims)};
    }
    const RankGroups groups = expert_data_parallel_groups(mesh.sizes(), mesh.names(), dims, ep);
    use_expert_optimizer_instances(mesh, groups, name, config_, groups_);
    return ExpertGroup{mesh.group_of(name, groups), group_containing(groups, mesh.rank(), name)};
  });
}

DdpEngine::DdpEngine(std::shared_ptr<torch::nn::Module> module, c10::intrusive_ptr<c10d::ProcessGroup> dp_group,
                     DdpConfig config)
    : dp_group_(std::move(dp_group)), config_(config) {
  TORCH_CHECK(dp_group_, "DistributedDataParallel: the data-parallel process group is null");
  TORCH_CHECK(
      config_.num_distributed_optimizer_instances == 1,
      "DistributedDataParallel: num_distributed_optimizer_instances = ", config_.num_distributed_optimizer_instances,
      " needs the DeviceMesh constructor (it makes the instance groups from the mesh); this one was given ",
      "a DP process group. Build it as DistributedDataParallel(model, mesh, \"dp\", config), or set the ",
      "instances to 1");
  groups_.dp = dp_group_;
  init(module, {}, *dp_group_, [this] { return expert_group_without_mesh({}); });
}

DdpEngine::DdpEngine(std::vector<NamedTensor> params, std::vector<NamedTensor> buffers, SyncGroups groups,
                     const std::vector<int64_t>& dp_global_ranks, DdpConfig config,
                     c10::intrusive_ptr<c10d::ProcessGroup> data_parallel_group)
    : dp_group_(data_parallel_group ? std::move(data_parallel_group) : groups.dp),
      groups_(std::move(groups)),
      config_(config) {
  TORCH_CHECK(dp_group_, "DistributedDataParallel: the data-parallel process group is null");
  init(std::move(params), std::move(buffers), dp_global_ranks, groups_.world ? *groups_.world : *dp_group_,
       [this, dp_global_ranks] {
         if (groups_.expert_dp) return ExpertGroup{groups_.expert_dp, {}};
         // EP 1 with optimizer instances: expert buckets are sharded as dense ones, within the instance.
         if (groups_.cross_instance) groups_.expert_instance = groups_.dp;
         return expert_group_without_mesh(dp_global_ranks);
       });
}

DdpEngine::ExpertGroup DdpEngine::expert_group_without_mesh(const std::vector<int64_t>& dp_global_ranks) const {
  TORCH_CHECK(config_.expert_parallel_size == 1, "DistributedDataParallel: the model has expert params ",
              "(declare_expert_param / ExpertParallel) and DdpConfig::expert_parallel_size = ",
              config_.expert_parallel_size, ", but DDP was given a data-parallel process group, not a DeviceMesh, ",
              "so it cannot make the expert-data-parallel groups; build DistributedDataParallel over the DeviceMesh ",
              "(e.g. DistributedDataParallel(model, mesh, {\"dp\"}, config)), or use expert_parallel_size = 1");
  return {dp_group_, dp_global_ranks};
}

void DdpEngine::init(const std::shared_ptr<torch::nn::Module>& module, const std::vector<int64_t>& dp_global_ranks,
                     c10d::ProcessGroup& agreement_group, const ExpertGroupMaker& expert_group) {
  TORCH_CHECK(module, "DistributedDataParallel: the module is null");
  std::vector<NamedTensor> params, buffers;
  for (const auto& item : module->named_parameters(/*recurse=*/true)) params.push_back({item.key(), item.value()});
  for (const auto& item : module->named_buffers(/*recurse=*/true)) buffers.push_back({item.key(), item.value()});
  init(std::move(params), std::move(buffers), dp_global_ranks, agreement_group, expert_group);
}

// What init()'s phases hand one another.
struct DdpEngine::InitState {
  std::vector<NamedTensor> params;   // every param by module path, frozen ones too
  std::vector<NamedTensor> buffers;  // the module's buffers
  const std::vector<int64_t>& dp_global_ranks;
  c10d::ProcessGroup& agreement_group;
  bool has_experts = false;
  std::vector<int64_t> expert_global_ranks = {};  // expert-DP rank -> global rank, for messages
  std::vector<NamedTensor> dense_params = {}, expert_params = {};
  std::vector<NamedTensor> expert_tensors = {};  // expert params and expert buffers
  std::vector<NamedParam> named = {};            // the params as the GradBuffer takes them, registration order
};

void DdpEngine::init(std::vector<NamedTensor> params, std::vector<NamedTensor> buffers,
                     const std::vector<int64_t>& dp_global_ranks, c10d::ProcessGroup& agreement_group,
                     const ExpertGroupMaker& expert_group) {
  InitState s{std::move(params), std::move(buffers), dp_global_ranks, agreement_group};
  agree_on_settings(s);
  make_reduction_groups(s, expert_group);
  verify_same_model(s);
  broadcast_initial_state(s);
  lay_out_gradient_buffer(s);
  check_layouts_agree(s);
  sync_tied_params_at_construction();
}

// A param whose storage has no bytes: one of a module whose "optim_grads_params" wrapper is gone while its
// unit was released (Note [A module outliving its ZeRO-3 wrapper], ddp_engine_controls.cpp). Its values are
// gone; the initial broadcast would read no memory. Checked after the claim (a module still wrapped is named so).
static void refuse_params_without_bytes(const std::vector<NamedTensor>& params) {
  for (const NamedTensor& p : params) {
    const at::Tensor& t = p.tensor;
    const bool released = t.numel() > 0 && !t.is_meta() && t.has_storage() && t.storage().nbytes() == 0;
    TORCH_CHECK(!released, "DistributedDataParallel: parameter '", p.name, "' holds no bytes: it belonged to an FSDP ",
                "unit of a wrapper under data_parallel_sharding_strategy 'optim_grads_params' that is gone while the ",
                "unit was released (a Python wrapper dropped: it does not gather the params back; a C++ one destroyed ",
                "while an exception unwound, or whose gather at destruction failed), so its values are gone. Wrap a ",
                "freshly built module instead and load a checkpoint (or a state dict taken before) through the new ",
                "wrapper");
  }
}

void DdpEngine::agree_on_settings(InitState& s) {
  // The agreement checks below use CPU tensors: a group a user made NCCL-only gets a Gloo backend for
  // them first (Note [Control plane on any group], mesh/process_group_factory.h).
  for (const auto* group : {&groups_.dp, &groups_.world, &groups_.tp}) {
    if (*group) ensure_cpu_backend(**group, "DistributedDataParallel");
  }
  // Before any collective: a param another live engine reduces is refused (Python ranks all wrap alike).
  claim_ = std::make_unique<ParamClaim>(s.params);
  refuse_params_without_bytes(s.params);
  // First, before any collective whose kind depends on them: the settings agree on every rank, then
  // they are validated (Note [Agree first, then validate], mesh/config_fields.h).
  s.has_experts = has_expert_params(s.params) || has_expert_params(s.buffers);
  verify_same_settings_across_ranks(s.agreement_group, config_settings(config_, groups_, s.has_experts),
                                    "DistributedDataParallel", "the DdpConfig settings");
  config_.validate();
  config_.check_combination();
  config_.apply_sharding_strategy();  // "optim" / "optim_grads": use_distributed_optimizer, as Megatron
  // After the agreement (it compares expert_parallel_size and the DP size): every rank reaches the same
  // verdict, rather than one failing alone while the others wait in the settings check.
  const int64_t ep = config_.expert_parallel_size;
  TORCH_CHECK(dp_group_->getSize() % ep == 0, "DistributedDataParallel: DdpConfig::expert_parallel_size = ", ep,
              " does not divide the data-parallel size ", dp_group_->getSize(),
              " (the DP (x CP) ranks, out of which expert parallel is carved: each block of ", ep,
              " consecutive DP ranks holds different experts); choose an expert_parallel_size that divides ",
              dp_group_->getSize(), ", or change the mesh");
}

void DdpEngine::make_reduction_groups(InitState& s, const ExpertGroupMaker& expert_group) {
  // Expert params are held by their expert-data-parallel group only: they are checked, broadcast and
  // reduced within it; dense params within DP.
  if (s.has_experts) {
    ExpertGroup made = expert_group();
    groups_.expert_dp = made.group;
    s.expert_global_ranks = made.global_ranks;
    ensure_cpu_backend(*groups_.expert_dp, "DistributedDataParallel");
  }
  std::tie(s.dense_params, s.expert_params) = split_experts(s.params);
  for (const auto& p : s.params) s.named.push_back({p.name, p.tensor});
  unique_params_ = deduplicate_params(s.named);
  s.expert_tensors = s.expert_params;
  std::vector<NamedTensor> buffers = std::move(s.buffers);
  if (s.has_experts) {
    const std::vector<bool> expert_buffer = expert_buffer_flags(s.params, buffers);
    for (size_t i = 0; i < buffers.size(); ++i) {
      if (!expert_buffer[i]) continue;
      declare_expert_param(buffers[i].tensor);  // so that checkpoints save it as an expert tensor
      expert_buffers_.push_back(buffers[i]);
      s.expert_tensors.push_back(buffers[i]);
    }
    buffers.erase(
        std::remove_if(buffers.begin(), buffers.end(), [](const NamedTensor& b) { return is_expert_param(b.tensor); }),
        buffers.end());
  }
  module_buffers_ = std::move(buffers);
}

void DdpEngine::verify_same_model(InitState& s) {
  const int64_t ep = config_.expert_parallel_size;
  if (s.has_experts) verify_expert_names_are_global(*dp_group_, s.expert_tensors, groups_.expert_dp->getSize(), ep);
  if (!config_.verify_model_across_ranks) return;
  // Compared within each DP group (expert params within each expert-DP group); the verdict is then
  // agreed over the whole mesh, so that a mismatch in one DP group stops every rank here rather than
  // leaving the others to hang in the next mesh-wide collective.
  std::string mismatch;
  try {
    verify_same_tensors_across_ranks(*dp_group_, s.dense_params, "parameter", s.dp_global_ranks);
    if (s.has_experts) {
      verify_same_tensors_across_ranks(*groups_.expert_dp, s.expert_params, "expert parameter", s.expert_global_ranks);
    }
  } catch (const c10::Error& e) {
    mismatch = no_expert_hint(ep, s.has_experts) + e.what_without_backtrace();
  }
  int64_t failed_ranks = mismatch.empty() ? 0 : 1;
  if (&s.agreement_group != dp_group_.get()) {
    at::Tensor verdict = at::full({1}, failed_ranks, at::kLong);
    all_reduce_sum_now(s.agreement_group, verdict, "the verdict of the model check");
    failed_ranks = verdict.item<int64_t>();
  }
  TORCH_CHECK(mismatch.empty(), mismatch);
  TORCH_CHECK(failed_ranks == 0, no_expert_hint(ep, s.has_experts),
              "DistributedDataParallel: the model differs across the data-parallel ranks of ",
              "another DP group of this mesh (", failed_ranks, " rank(s) report it, naming the parameter: see their ",
              "errors); this rank's DP group agrees. Build the same model, in the same registration order, on every "
              "rank");
}

void DdpEngine::broadcast_initial_state(const InitState& s) {
  if (!config_.broadcast_from_rank0) return;
  std::vector<NamedTensor> state, expert_state, tp_replicated_state;
  for (const auto& p : unique_params_) {
    (is_expert_param(p.param) ? expert_state : state).push_back({p.name, p.param});
    if (!get_placement(p.param).is_shard()) tp_replicated_state.push_back({p.name, p.param});
  }
  state.insert(state.end(), module_buffers_.begin(), module_buffers_.end());
  expert_state.insert(expert_state.end(), expert_buffers_.begin(), expert_buffers_.end());
  tp_replicated_state.insert(tp_replicated_state.end(), module_buffers_.begin(), module_buffers_.end());
  tp_replicated_state.insert(tp_replicated_state.end(), expert_buffers_.begin(), expert_buffers_.end());
  // DP first (each TP column takes its DP rank 0's values; experts their expert-DP rank 0's), then TP
  // for what every TP rank holds whole: all replicas of a replicated param then equal one rank's.
  broadcast_from_group_rank0(*dp_group_, state, "the initial parameters and buffers (from DP rank 0)");
  if (s.has_experts) {
    broadcast_from_group_rank0(*groups_.expert_dp, expert_state,
                               "the initial expert parameters and buffers (from expert-data-parallel rank 0)");
  }
  if (groups_.tp) {
    broadcast_from_group_rank0(*groups_.tp, tp_replicated_state,
                               "the initial TP-replicated parameters and buffers (from TP rank 0)");
  }
}

void DdpEngine::lay_out_gradient_buffer(const InitState& s) {
  buffer_ = std::make_unique<GradBuffer>(s.named, groups_, static_cast<GradBufferConfig>(config_));
  // A norm or a step must then cover every chunk of this rank (grad_buffer/run_stats.h).
  declare_pipeline_chunks(buffer_.get(), config_.virtual_pipeline_size);
  for (int64_t i = 0; i < static_cast<int64_t>(buffer_->params().size()); ++i) {
    if (!buffer_->placement(i).is_shard()) tp_replicated_.push_back(buffer_->params()[i]);
  }
}

void DdpEngine::check_layouts_agree(const InitState& s) {
  verify_same_settings_across_ranks(*dp_group_, layout_settings(*buffer_, LayoutPart::kDense),
                                    "DistributedDataParallel", "the gradient bucket layouts");
  if (s.has_experts) {
    verify_same_settings_across_ranks(*groups_.expert_dp, layout_settings(*buffer_, LayoutPart::kExpert),
                                      "DistributedDataParallel", "the expert gradient bucket layouts");
  }
  if (groups_.world && groups_.tp_size > 1) {
    verify_same_settings_across_ranks(*groups_.world, layout_settings(*buffer_, LayoutPart::kTpPartial),
                                      "DistributedDataParallel", "the TP-partial gradient bucket layouts");
  }
}

std::vector<at::Tensor> DdpEngine::parameters() const {
  std::vector<at::Tensor> out;
  out.reserve(unique_params_.size());
  for (const auto& p : unique_params_) out.push_back(p.param);
  return out;
}

// Note [Module buffers once per step]
//   PyTorch's DDP broadcasts the buffers before every forward outside no_sync(). Under a pipeline
//   schedule (1F1B: micro-batch 1's forward before micro-batch 0's backward), or plain accumulation
//   with several forwards before their backwards, that write lands in place on a buffer an earlier
//   forward of the step saved for backward (a rotary table multiplying the queries), and autograd
//   fails ("modified by an inplace operation") on every rank but DP rank 0. So the buffers are
//   broadcast once per step, before its first training forward (the first after zero_grad_buffer(),
//   whatever the sync switch says: every micro-batch of the step then sees DP rank 0's values), and
//   only the tensors whose bits differ from rank 0's are written: a constant table never is.
void DdpEngine::before_forward() {
  if (!c10::GradMode::is_enabled()) return;
  buffer_->check_no_sync_pending("DistributedDataParallel::forward");
  maybe_check_tp_replicas();
  if (!config_.broadcast_buffers || !buffers_broadcast_due_) return;
  buffers_broadcast_due_ = false;
  if (!module_buffers_.empty()) {
    broadcast_changed_from_group_rank0(*dp_group_, module_buffers_,
                                       "the module buffers (broadcast_buffers, from DP rank 0)");
  }
  if (!expert_buffers_.empty()) {
    broadcast_changed_from_group_rank0(
        *groups_.expert_dp, expert_buffers_,
        "the expert module buffers (broadcast_buffers, from expert-data-parallel rank 0)");
  }
}

void DdpEngine::maybe_check_tp_replicas() {
  const int64_t every = config_.tp_replica_check_interval;
  if (!groups_.tp || every == 0 || tp_replicated_.empty()) return;
  const int64_t step = buffer_->stats().syncs_completed;
  if (step < 1 || (step - 1) % every != 0 || step == last_replica_check_) return;
  last_replica_check_ = step;
  if (ParamGather* gather = param_gather()) gather->wait_all();  // the params must be this step's
  // "optim_grads_params": every rank reads every unit alike; gathered one at a time, then released.
  std::optional<ShardedParams::UseScope> units;
  if (ShardedParams* sharded = sharded_params()) units.emplace(sharded, /*forward=*/false);
  std::vector<NamedTensor> tensors;
  for (const auto& p : tp_replicated_) tensors.push_back({p.name, p.param});
  verify_tp_replicas_identical(*groups_.tp, tensors, step);
}

void DdpEngine::load_state_dict(const torch::OrderedDict<std::string, at::Tensor>& state) {
  buffer_->check_no_sync_pending("DistributedDataParallel::load_state_dict");
  TORCH_CHECK(
      !config_.shards_params(), "DistributedDataParallel::load_state_dict: under data_parallel_sharding_strategy '",
      kShardOptimGradsParams, "' a rank holds only its shards of the params, which a whole-param ",
      "state dict does not write; load a checkpoint (meshddp::load_checkpoint), or use '", kShardOptimGrads, "'");
  if (ParamGather* gather = param_gather()) gather->wait_all();  // it would overwrite what we load
  std::unordered_map<std::string, at::Tensor> targets;
  std::vector<std::string> required;
  for (const auto& p : unique_params_) {
    required.push_back(p.name);
    targets[p.name] = p.param;
    for (const auto& alias : p.aliases) targets[alias] = p.param;
  }
  for (const auto* list : {&module_buffers_, &expert_buffers_}) {
    for (const auto& b : *list) {
      required.push_back(b.name);
      targets[b.name] = b.tensor;
    }
  }
  // Check everything before changing anything.
  for (const auto& item : state) {
    const auto it = targets.find(item.key());
    TORCH_CHECK(it != targets.end(), "DistributedDataParallel::load_state_dict: '", item.key(),
                "' is not a parameter or buffer of the wrapped module");
    TORCH_CHECK(item.value().sizes() == it->second.sizes(), "DistributedDataParallel::load_state_dict: '", item.key(),
                "' has shape ", item.value().sizes(), " but the module's (this rank's shard, for TP) is ",
                it->second.sizes());
  }
  for (const auto& name : required) {
    bool given = state.contains(name);
    for (const auto& p : unique_params_) {
      if (p.name != name) continue;
      for (const auto& alias : p.aliases) given = given || state.contains(alias);
    }
    TORCH_CHECK(given, "DistributedDataParallel::load_state_dict: '", name, "' is missing from the state (",
                state.size(), " entries given); give every parameter and buffer of the module");
  }
  c10::NoGradGuard no_grad;
  for (const auto& item : state) targets.at(item.key()).detach().copy_(item.value());
  if (ParamBuffer* params = buffer_->param_buffer()) params->notify_params_changed();
}

at::Tensor DdpEngine::main_grad(const std::string& name) const {
  const auto& params = buffer_->params();
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].name == name) return buffer_->main_grad(static_cast<int64_t>(i));
    for (const auto& alias : params[i].aliases) {
      if (alias == name) return buffer_->main_grad(static_cast<int64_t>(i));
    }
  }
  TORCH_CHECK(false, "DistributedDataParallel::main_grad: no trainable parameter named '", name, "'");
}

}  // namespace meshddp
