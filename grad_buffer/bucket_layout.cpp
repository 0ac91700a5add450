#include "grad_buffer/bucket_layout.h"

#include <c10/util/Exception.h>

#include <optional>

namespace meshddp {
namespace {

struct OpenBucket {
  int64_t begin = 0;
  std::vector<int64_t> params;
};

}  // namespace

BucketLayout assign_buckets(const std::vector<ParamSpec>& params, const LayoutConfig& config) {
  TORCH_CHECK(config.dp_size >= 1, "assign_buckets: dp_size must be >= 1, got ", config.dp_size);
  TORCH_CHECK(config.expert_dp_size >= 1, "assign_buckets: expert_dp_size must be >= 1, got ", config.expert_dp_size);
  BucketLayout layout;
  layout.slots.resize(params.size());
  std::vector<int64_t> cursor;                  // per buffer: next free element
  std::vector<std::optional<OpenBucket>> open;  // per buffer: the bucket being filled
  // A bucket divides into equal shards over its own reduction group (Note [Bucket layout]).
  auto bucket_multiple = [&](int64_t buffer) {
    return (layout.buffers[buffer].key.expert ? config.expert_dp_size : config.dp_size) * kAlignmentElems;
  };

  auto close_bucket = [&](int64_t buffer) {
    OpenBucket& b = *open[buffer];
    BucketSpan span;
    span.buffer = buffer;
    span.begin = b.begin;
    span.end_unpadded = cursor[buffer];
    span.end = config.pad_for_reduce_scatter ? round_up(cursor[buffer], bucket_multiple(buffer)) : cursor[buffer];
    span.params = std::move(b.params);
    const auto index = static_cast<int64_t>(layout.buckets.size());
    for (int64_t p : span.params) layout.slots[p].bucket = index;
    cursor[buffer] = span.end;
    layout.buffers[buffer].buckets.push_back(index);
    layout.buckets.push_back(std::move(span));
    open[buffer].reset();
  };

  for (auto i = static_cast<int64_t>(params.size()) - 1; i >= 0; --i) {
    const ParamSpec& p = params[i];
    TORCH_CHECK(!p.name.empty(), "assign_buckets: parameter #", i, " has an empty name");
    TORCH_CHECK(p.numel >= 0, "assign_buckets: parameter '", p.name, "' has numel ", p.numel);
    // A unit boundary closes every open bucket (Note [Bucket layout]: FSDP units).
    if (i + 1 < static_cast<int64_t>(params.size()) && params[i + 1].unit != p.unit) {
      for (int64_t buffer = 0; buffer < static_cast<int64_t>(layout.buffers.size()); ++buffer) {
        if (open[buffer]) close_bucket(buffer);
      }
    }
    const BufferKey key{p.param_dtype, p.grad_dtype, p.device, p.tp_partial, p.expert, p.tied};
    int64_t buffer = 0;
    while (buffer < static_cast<int64_t>(layout.buffers.size()) && !(layout.buffers[buffer].key == key)) ++buffer;
    if (buffer == static_cast<int64_t>(layout.buffers.size())) {
      layout.buffers.push_back(BufferSpec{key, 0, {}});
      cursor.push_back(0);
      open.emplace_back();
    }
    if (!open[buffer]) open[buffer] = OpenBucket{cursor[buffer], {}};
    const int64_t offset = config.pad_for_reduce_scatter ? round_up(cursor[buffer], kAlignmentElems) : cursor[buffer];
    layout.slots[i] = ParamSlot{buffer, -1, offset, p.numel};
    open[buffer]->params.push_back(i);
    cursor[buffer] = offset + p.numel;
    const int64_t bytes = (cursor[buffer] - open[buffer]->begin) * static_cast<int64_t>(c10::elementSize(p.grad_dtype));
    // Params tied across stages stay in one bucket: the two stages' tied buckets are summed over the
    // embedding group, so they must match whatever bucket_bytes each stage's chunk uses.
    if (bytes >= static_cast<int64_t>(config.bucket_bytes) && !key.tied) close_bucket(buffer);
  }
  for (int64_t buffer = 0; buffer < static_cast<int64_t>(layout.buffers.size()); ++buffer) {
    if (open[buffer]) close_bucket(buffer);
    layout.buffers[buffer].numel = cursor[buffer];
  }
  return layout;
}

}  // namespace meshddp
