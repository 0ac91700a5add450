#include "plugin/distributed_data_parallel.h"

#include "plugin/model_sync.h"

namespace meshddp {

DdpEngine::DdpEngine(std::shared_ptr<torch::nn::Module> module, const DeviceMesh& mesh, const std::string& dp_dim,
                     DdpConfig config)
    : dp_group_(mesh[dp_dim]), config_(config) {
  groups_.dp = dp_group_;
  groups_.world = mesh.world();
  for (size_t d = 0; d < mesh.names().size(); ++d) {
    if (mesh.names()[d] == "tp") {
      groups_.tp_rank = mesh.coordinates()[d];
      groups_.tp_size = mesh.sizes()[d];
    }
  }
  init(module, mesh.group_ranks(dp_dim));
}

DdpEngine::DdpEngine(std::shared_ptr<torch::nn::Module> module, c10::intrusive_ptr<c10d::ProcessGroup> dp_group,
                     DdpConfig config)
    : dp_group_(std::move(dp_group)), config_(config) {
  TORCH_CHECK(dp_group_, "DistributedDataParallel: the data-parallel process group is null");
  groups_.dp = dp_group_;
  init(module, {});
}

DdpEngine::DdpEngine(std::vector<NamedTensor> params, std::vector<NamedTensor> buffers, SyncGroups groups,
                     const std::vector<int64_t>& dp_global_ranks, DdpConfig config)
    : dp_group_(groups.dp), groups_(std::move(groups)), config_(config) {
  TORCH_CHECK(dp_group_, "DistributedDataParallel: the data-parallel process group is null");
  init(std::move(params), std::move(buffers), dp_global_ranks);
}

void DdpEngine::init(const std::shared_ptr<torch::nn::Module>& module, const std::vector<int64_t>& dp_global_ranks) {
  TORCH_CHECK(module, "DistributedDataParallel: the module is null");
  std::vector<NamedTensor> params;
  std::vector<NamedTensor> buffers;
  for (const auto& item : module->named_parameters(/*recurse=*/true)) params.push_back({item.key(), item.value()});
  for (const auto& item : module->named_buffers(/*recurse=*/true)) buffers.push_back({item.key(), item.value()});
  init(std::move(params), std::move(buffers), dp_global_ranks);
}

void DdpEngine::init(std::vector<NamedTensor> params, std::vector<NamedTensor> buffers,
                     const std::vector<int64_t>& dp_global_ranks) {
  config_.validate();
  std::vector<NamedTensor> state = params;
  state.insert(state.end(), buffers.begin(), buffers.end());
  if (config_.verify_model_across_ranks) {
    verify_same_tensors_across_ranks(*dp_group_, params, "parameter", dp_global_ranks);
  }
  if (config_.broadcast_from_rank0) broadcast_from_dp_rank0(*dp_group_, state);

  std::vector<NamedParam> named;
  for (auto& p : params) named.push_back({p.name, p.tensor});
  buffer_ = std::make_unique<GradBuffer>(std::move(named), groups_, static_cast<GradBufferConfig>(config_));
}

at::Tensor DdpEngine::main_grad(const std::string& name) const {
  const auto& params = buffer_->params();
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].name == name) return buffer_->main_grad(static_cast<int64_t>(i));
  }
  TORCH_CHECK(false, "DistributedDataParallel::main_grad: no trainable parameter named '", name, "'");
}

}  // namespace meshddp
