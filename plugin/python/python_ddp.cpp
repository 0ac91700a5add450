#include "plugin/python/python_ddp.h"

#include "grad_buffer/grad_buffer.h"
#include "grad_buffer/param_buffer.h"
#include "grad_buffer/param_gather.h"
#include "grad_buffer/sharded_params.h"
#include "mesh/placement.h"
#include "optimizer/shard_layout.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace meshddp {

struct PythonDdp::Relay {
  std::shared_ptr<torch::autograd::Node> accumulator;  // the leaf keeps only a weak_ptr to it
  uintptr_t key = 0;
};

namespace {

// Records each DTensor param's TP placement on its local tensor (read by the GradBuffer's norm and
// checkpoint code) before the engine lays the buffer out. Returns `params` unchanged.
std::vector<NamedTensor> with_placements(std::vector<NamedTensor> params, const std::vector<DtensorParam>& dtensors,
                                         const SyncGroups& groups) {
  for (const auto& d : dtensors) {
    TORCH_CHECK(d.leaf.defined() && d.local.defined(), "meshddp: DTensor parameter '", d.name, "' is undefined");
    set_placement(d.local, d.shard_dim >= 0 ? Placement::shard(d.shard_dim, groups.tp_size, groups.tp_rank)
                                            : Placement::replicate());
  }
  return params;
}

int64_t index_in_buffer(const GradBuffer& buffer, const DtensorParam& d) {
  const auto& params = buffer.params();
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].param.unsafeGetTensorImpl() == d.local.unsafeGetTensorImpl()) return static_cast<int64_t>(i);
  }
  TORCH_CHECK(false, "meshddp: DTensor parameter '", d.name, "' has no trainable local tensor in the gradient buffer; ",
              "its local tensor must require grad");
}

}  // namespace

PythonDdp::PythonDdp(std::vector<NamedTensor> params, std::vector<NamedTensor> buffers,
                     std::vector<DtensorParam> dtensors, SyncGroups groups, const std::vector<int64_t>& dp_global_ranks,
                     DdpConfig config, c10::intrusive_ptr<c10d::ProcessGroup> data_parallel_group)
    : DdpEngine(with_placements(std::move(params), dtensors, groups), std::move(buffers), groups, dp_global_ranks,
                config, std::move(data_parallel_group)),
      dtensors_(std::move(dtensors)) {
  leave_params_whole_at_destruction_ = false;  // destroyed by Python's GC: Note [A module outliving its ZeRO-3 wrapper]
  TORCH_CHECK(dtensors_.empty() || !config.find_unused_parameters,
              "meshddp.DistributedDataParallel: find_unused_parameters is not supported for DTensor parameters (",
              dtensors_.front().name, "): the autograd graph reaches their DTensor, not the local tensor the ",
              "buffer holds. Unused DTensor params still work without it: finish_grad_sync() reduces their zeros");
  for (const auto& d : dtensors_) {
    const int64_t index = index_in_buffer(buffer(), d);
    const bool shards_grads = this->config().shards_grads();
    if (!shards_grads) buffer().zero_slot_every_step(index);  // the DTensor's AccumulateGrad adds into the slot
    auto relay = std::make_unique<Relay>();
    relay->accumulator = torch::autograd::impl::grad_accumulator(d.leaf);
    TORCH_INTERNAL_ASSERT(relay->accumulator, "no grad accumulator for DTensor parameter ", d.name);
    GradBuffer* grads = &buffer();
    const size_t which = relays_.size();
    relay->key = relay->accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, grads, index, which, shards_grads](const torch::autograd::variable_list& outputs,
                                                  const torch::autograd::variable_list&) {
          const DtensorParam& d = dtensors_[which];
          if (shards_grads) {  // the Python post-accumulate hook moved the gradient onto the local tensor
            TORCH_CHECK(d.local.grad().defined() && !d.leaf.grad().defined(),
                        "meshddp.DistributedDataParallel: DTensor parameter '", d.name, "' got a gradient that ",
                        "did not reach meshddp's buffer under data_parallel_sharding_strategy '", kShardOptimGrads,
                        "': the wrapper's post-accumulate-grad hook on the param did not run (were the param's ",
                        "hooks cleared?). Re-wrap the model");
            grads->on_grad_accumulated(index);
            return outputs;
          }
          TORCH_CHECK(
              which < dtensor_grads_.size() && d.leaf.grad().is_same(dtensor_grads_[which]),
              "meshddp.DistributedDataParallel: DTensor parameter '", d.name, "' got a gradient while its ",
              ".grad was not its slot in meshddp's buffer (was it set to None, e.g. by optimizer.zero_grad()?); ",
              "this gradient missed the buffer. Call ddp.zero_grad_buffer() between steps instead");
          grads->on_grad_accumulated(index);
          return outputs;
        }));
    relays_.push_back(std::move(relay));
  }
}

PythonDdp::~PythonDdp() {
  for (auto& r : relays_) r->accumulator->del_post_hook(r->key);
}

void PythonDdp::set_dtensor_grads(std::vector<at::Tensor> grads) {
  TORCH_CHECK(grads.size() == dtensors_.size(), "meshddp: ", grads.size(), " DTensor grads for ", dtensors_.size(),
              " DTensor parameters");
  dtensor_grads_ = std::move(grads);
  for (size_t i = 0; i < dtensors_.size(); ++i) dtensors_[i].leaf.mutable_grad() = dtensor_grads_[i];
}

void PythonDdp::check_dtensors_still_trainable(const char* who) const {
  for (const auto& d : dtensors_) {
    TORCH_CHECK(d.leaf.requires_grad(), "meshddp.DistributedDataParallel.", who, ": DTensor parameter '", d.name,
                "' was trainable when the model was wrapped but now has requires_grad=False (frozen after wrapping). ",
                "Its slot in the gradient buffer would still take part in every step with a zero gradient, which an ",
                "optimizer with weight decay or momentum still applies to it. Which params train is fixed when ",
                "DistributedDataParallel is built: set requires_grad before wrapping (re-wrap the model, with a new ",
                "optimizer, to change it)");
  }
}

void PythonDdp::finish_grad_sync() {
  check_dtensors_still_trainable("finish_grad_sync()");
  DdpEngine::finish_grad_sync();
}

void PythonDdp::zero_grad_buffer() {
  check_dtensors_still_trainable("zero_grad_buffer()");
  DdpEngine::zero_grad_buffer();
  for (size_t i = 0; i < dtensor_grads_.size(); ++i) dtensors_[i].leaf.mutable_grad() = dtensor_grads_[i];
}

namespace {

ShardedParams& sharded_or_throw(ShardedParams* sharded, const DdpConfig& config, const char* who) {
  TORCH_CHECK(sharded != nullptr, "meshddp.DistributedDataParallel.", who, " needs data_parallel_sharding_strategy '",
              kShardOptimGradsParams, "' (params sharded), but this wrapper's is '", config.sharding_strategy(),
              "': its params are whole tensors");
  return *sharded;
}

// Bytes of the whole params in the gradient buffer (trainable ones), for the strategies that keep them whole.
int64_t whole_param_bytes(const GradBuffer& buffer) {
  if (const ParamBuffer* params = buffer.param_buffer()) return params->bytes();
  int64_t bytes = 0;
  for (const NamedParam& p : buffer.params()) bytes += static_cast<int64_t>(p.param.nbytes());
  return bytes;
}

}  // namespace

void PythonDdp::intercept_param_reads_in_this_thread() {
  if (ShardedParams* sharded = sharded_params()) ShardedParams::UseScope turn_on(sharded, /*forward=*/false);
}

void PythonDdp::gather_all_params() {
  sharded_or_throw(sharded_params(), config(), "gather_all_params()").gather_all();
}

void PythonDdp::release_all_params() {
  sharded_or_throw(sharded_params(), config(), "release_all_params()").release_all();
}

std::vector<std::tuple<std::string, int64_t, at::Tensor>> PythonDdp::param_shard_pieces() const {
  const ShardedParams& sharded = sharded_or_throw(sharded_params(), config(), "param_shard_pieces()");
  const GradBuffer& buffer = grad_buffer();
  std::vector<std::tuple<std::string, int64_t, at::Tensor>> out;
  for (const BucketShard& shard :
       shard_buckets(buffer.layout(), buffer.groups().dp_rank(), buffer.groups().dp_size())) {
    const at::Tensor& kept = sharded.bucket_shard(shard.bucket);
    TORCH_INTERNAL_ASSERT(kept.numel() == shard.numel, "PythonDdp: bucket ", shard.bucket, "'s shard has ",
                          kept.numel(), " elements, the layout's ", shard.numel);
    for (const ShardSegment& seg : shard.segments) {
      out.emplace_back(buffer.params()[seg.param].name, seg.param_offset, kept.narrow(0, seg.shard_offset, seg.numel));
    }
  }
  return out;
}

int64_t PythonDdp::param_storage_bytes() const {
  const ShardedParams* sharded = sharded_params();
  return sharded ? sharded->resident_bytes() : whole_param_bytes(grad_buffer());
}

int64_t PythonDdp::peak_param_storage_bytes() const {
  const ShardedParams* sharded = sharded_params();
  return sharded ? sharded->peak_resident_bytes() : whole_param_bytes(grad_buffer());
}

void PythonDdp::reset_peak_param_storage() {
  if (ShardedParams* sharded = sharded_params()) sharded->reset_peak();
}

int64_t PythonDdp::param_shard_bytes() const {
  const ShardedParams* sharded = sharded_params();
  return sharded ? sharded->shard_bytes() : whole_param_bytes(grad_buffer());
}

PythonDdp::CompiledSectionScope::CompiledSectionScope(ShardedParams& sharded, const std::vector<at::Tensor>& inputs)
    : params_(sharded.use_units_of(inputs, "a compiled section of the wrapped module's forward")) {}

std::unique_ptr<PythonDdp::CompiledSectionScope> PythonDdp::open_compiled_section(
    const std::vector<at::Tensor>& inputs) const {
  ShardedParams& sharded = sharded_or_throw(sharded_params(), config(), "open_compiled_section()");
  return std::make_unique<CompiledSectionScope>(sharded, inputs);
}

void PythonDdp::gather_for_compiled_backward(const std::vector<at::Tensor>& params) const {
  ShardedParams& sharded = sharded_or_throw(sharded_params(), config(), "gather_for_compiled_backward()");
  TORCH_INTERNAL_ASSERT(torch::autograd::get_current_node() != nullptr,
                        "PythonDdp: gather_for_compiled_backward() outside backward");
  sharded.use_units_of(params, "a compiled section's backward");
}

std::vector<std::string> PythonDdp::fsdp_unit_names() const {
  const ShardedParams& sharded = sharded_or_throw(sharded_params(), config(), "fsdp_unit_names()");
  std::vector<std::string> names;
  for (int64_t u = 0; u < sharded.num_units(); ++u) names.push_back(sharded.unit_name(u));
  return names;
}

std::vector<std::string> PythonDdp::param_names() const {
  std::vector<std::string> names;
  for (const auto& p : grad_buffer()->params()) names.push_back(p.name);
  return names;
}

}  // namespace meshddp
