#include "grad_buffer/param_buffer.h"

#include "grad_buffer/grad_buffer.h"
#include "grad_buffer/lazy_zeros.h"

#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

namespace meshddp {
namespace {

std::vector<at::Tensor> allocate(const BucketLayout& layout) {
  std::vector<at::Tensor> buffers;
  for (const auto& spec : layout.buffers) {
    // Lazily zeroed (the padding stays zero); each param's copy below touches only its own slot.
    buffers.push_back(lazy_zeros(spec.numel, at::TensorOptions().dtype(spec.key.param_dtype).device(spec.key.device)));
  }
  return buffers;
}

std::vector<at::Tensor> bucket_ranges(const BucketLayout& layout, const std::vector<at::Tensor>& buffers) {
  std::vector<at::Tensor> ranges;
  for (const BucketSpan& span : layout.buckets)
    ranges.push_back(buffers[span.buffer].narrow(0, span.begin, span.numel()));
  return ranges;
}

std::vector<ParamGather::Bucket> gather_buckets(const std::vector<at::Tensor>& ranges,
                                                std::vector<ParamGather::Bucket> buckets) {
  TORCH_INTERNAL_ASSERT(buckets.size() == ranges.size(), "ParamBuffer: ", buckets.size(), " buckets for ",
                        ranges.size(), " ranges");
  for (size_t b = 0; b < ranges.size(); ++b) {
    const at::Tensor& full = ranges[b];
    const c10d::ProcessGroup& group = *buckets[b].group;
    const int64_t n = full.numel() / group.getSize();
    buckets[b].full = full;
    buckets[b].shard = full.narrow(0, group.getRank() * n, n);
  }
  return buckets;
}

std::unique_ptr<ShardedParams> make_sharded(const BucketLayout& layout, std::vector<NamedParam>& params,
                                            const std::vector<ParamGather::Bucket>& buckets, const FsdpUnits* units) {
  if (units == nullptr) return nullptr;
  std::vector<ShardedParams::Bucket> sharded;
  for (const ParamGather::Bucket& b : buckets) sharded.push_back({b.what, b.group});
  return std::make_unique<ShardedParams>(layout, params, std::move(sharded), units->unit_of, units->names);
}

std::vector<at::Tensor> sharded_bucket_data(const ShardedParams& sharded, size_t num_buckets) {
  std::vector<at::Tensor> out;
  for (size_t b = 0; b < num_buckets; ++b) out.push_back(sharded.bucket_full(static_cast<int64_t>(b)));
  return out;
}

}  // namespace

ParamBuffer::ParamBuffer(const BucketLayout& layout, std::vector<NamedParam>& params,
                         std::vector<ParamGather::Bucket> buckets, const FsdpUnits* units)
    : sharded_(make_sharded(layout, params, buckets, units)),
      buffers_(sharded_ ? std::vector<at::Tensor>() : allocate(layout)),
      bucket_data_(sharded_ ? sharded_bucket_data(*sharded_, layout.buckets.size()) : bucket_ranges(layout, buffers_)),
      gather_(sharded_ ? std::vector<ParamGather::Bucket>() : gather_buckets(bucket_data_, std::move(buckets))) {
  for (const BucketSpan& span : layout.buckets) bucket_begin_.push_back(span.begin);
  for (size_t i = 0; i < params.size() && !sharded_; ++i) {
    const ParamSlot& slot = layout.slots[i];
    at::Tensor& param = params[i].param;
    at::Tensor view = buffers_[slot.buffer].narrow(0, slot.offset, slot.numel).view(param.sizes());
    view.copy_(param.detach());
    // Same TensorImpl (modules, optimizers and autograd keep their references), new storage: the
    // param all-gather now writes the module's parameters in place.
    param.set_data(view);
  }
}

void ParamBuffer::start_param_sync(bool async) {
  if (sharded_) {
    sharded_->release_all();
  } else {
    gather_.start(async);
  }
}

int64_t ParamBuffer::bytes() const {
  if (sharded_) return sharded_->resident_bytes();
  int64_t bytes = 0;
  for (const at::Tensor& buffer : buffers_) bytes += static_cast<int64_t>(buffer.nbytes());
  return bytes;
}

void ParamBuffer::check_param_in_place(const NamedParam& p, const ParamSlot& slot, const char* who) const {
  if (p.param.numel() == 0) return;  // no elements to reach (an empty tensor's data pointer is not its slot's)
  if (sharded_) {  // no bytes while its unit is released: the storage and the offset say where it lives
    const at::Tensor& full = bucket_data_[slot.bucket];
    TORCH_CHECK(p.param.has_storage() &&
                    p.param.storage().unsafeGetStorageImpl() == full.storage().unsafeGetStorageImpl() &&
                    p.param.storage_offset() == slot.offset - bucket_begin_[slot.bucket],
                "GradBuffer::", who, ": parameter ", describe_param_name(p),
                " no longer lives in its bucket's storage under data_parallel_sharding_strategy 'optim_grads_params' ",
                "(its data was replaced after wrapping: param.data = ..., param.set_data(...)); the optimizer's ",
                "updates and the parameter gathers would no longer reach it. Load new values through the checkpoint ",
                "functions, or use 'optim'");
    return;
  }
  const auto* expected = static_cast<const char*>(buffers_[slot.buffer].const_data_ptr()) +
                         slot.offset * static_cast<int64_t>(buffers_[slot.buffer].element_size());
  TORCH_CHECK(p.param.const_data_ptr() == expected, "GradBuffer::", who, ": parameter ", describe_param_name(p),
              " no longer lives in its place of the distributed optimizer's param buffer (its data was replaced ",
              "after wrapping: param.data = ..., param.set_data(...)); the optimizer's updates and the param ",
              "all-gather would no longer reach it. Write new values in place (param.copy_(...) under no_grad, ",
              "then opt.reload_masters_from_params(), or ddp.load_state_dict(...))");
}

}  // namespace meshddp
