// Splits parameters into flat buffers and buckets, in reverse registration order. Pure host logic:
// no tensors, no CUDA, no communication, so every rank computes the identical layout from the same
// (params, config) and the rules are unit-testable without a process group.
//
// Note [Bucket layout]
// - One flat buffer per (param dtype, grad dtype, device, TP-partial or not, reduction group). Params are placed
//   walking the
//   registration order backwards (the last-registered param first), which is roughly the order
//   backward produces gradients, so the first buckets complete first.
// - A bucket closes as soon as it holds >= bucket_bytes of gradients (it may overshoot by one param);
//   bucket_bytes == 0 closes a bucket after every param. A param never straddles two buckets.
// - Buckets get their global index (= launch order) when they close, across all buffers, so a
//   small buffer's bucket launches as soon as its last gradient is in, not after every bucket of a
//   bigger buffer. Buckets still open at the end close in buffer order.
// - With pad_for_reduce_scatter, each param starts at a multiple of kAlignmentElems and each bucket
//   ends at a multiple of dp_size * kAlignmentElems. So every bucket divides into dp_size equal
//   shards, and every shard and every param starts 64-element aligned (256 B in fp32, 128 B in
//   bf16): whole cache lines and vector loads for the optimizer kernels, and the shard boundaries of
//   one buffer never depend on another buffer. Cost: < kAlignmentElems per param plus
//   < dp_size * kAlignmentElems per bucket. Without it, params are packed densely (no padding).
// - Reduction groups (expert parallelism): a param's gradient is reduced over the ranks that hold a replica of
//   it. Dense params: the DP (x CP) group; expert (MoE) params: the expert-data-parallel group
//   (mesh/reduction_groups.h). They live in buffers of their own (BufferKey::expert), so a bucket never
//   mixes groups, and an expert bucket is padded to a multiple of expert_dp_size * kAlignmentElems
//   (its ZeRO-1 shards are 1/expert_dp_size of it).
// - FSDP units (ParamSpec::unit, "optim_grads_params"): when the walk reaches a param of another unit
//   than the param before it, every open bucket closes, so a bucket's params are all of one unit and a
//   unit is gathered and released as whole buckets (Note [Sharded parameters], sharded_params.h).
#pragma once

#include "grad_buffer_config.h"  // kDefaultBucketBytes

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace meshddp {

constexpr int64_t kAlignmentElems = 64;

struct ParamSpec {
  std::string name;  // module path, for messages
  int64_t numel = 0;
  c10::ScalarType param_dtype = c10::ScalarType::Float;
  c10::ScalarType grad_dtype = c10::ScalarType::Float;  // the main grad's dtype (fp32 when reducing in fp32)
  c10::Device device{c10::DeviceType::CPU};
  bool tp_partial = false;  // gradient is a partial sum over TP: kept in buffers of its own
  bool expert = false;      // an expert (MoE) param: reduced over the expert-data-parallel group, in buffers of its own
  bool tied = false;        // tied across pipeline stages: summed over the embedding group first, in buffers of its own
  std::vector<int64_t> shape = {};  // the param's (local) sizes; used only by the whole-param placement's cost
  int64_t unit = 0;                 // its FSDP unit ("optim_grads_params", grad_buffer/fsdp_units.h): a bucket
                                    // never holds params of two units; all 0 = no unit boundaries
};

struct LayoutConfig {
  size_t bucket_bytes = kDefaultBucketBytes;  // a bucket closes once it reaches this; 0 = one param per bucket
  bool pad_for_reduce_scatter = false;        // align params, pad buckets to dp_size * kAlignmentElems
  int64_t dp_size = 1;                        // data-parallel group size (>= 1); only used for padding
  int64_t expert_dp_size = 1;                 // expert-data-parallel group size (>= 1): pads expert buckets
};

struct BufferKey {
  c10::ScalarType param_dtype;
  c10::ScalarType grad_dtype;
  c10::Device device;
  bool tp_partial = false;
  bool expert = false;  // reduced over the expert-data-parallel group (ParamSpec::expert)
  bool tied = false;    // tied across pipeline stages (ParamSpec::tied)
  bool operator==(const BufferKey&) const = default;
};

// Where one param's gradient lives.
struct ParamSlot {
  int64_t buffer = -1;  // index into BucketLayout::buffers
  int64_t bucket = -1;  // global bucket index
  int64_t offset = 0;   // element offset in its buffer
  int64_t numel = 0;
};

struct BucketSpan {
  int64_t buffer = -1;          // the flat buffer it is a range of
  int64_t begin = 0;            // element offset in that buffer
  int64_t end = 0;              // one past the last element, padding included
  int64_t end_unpadded = 0;     // one past the last param element
  std::vector<int64_t> params;  // param indices, in placement order
  int64_t numel() const { return end - begin; }
};

struct BufferSpec {
  BufferKey key;
  int64_t numel = 0;             // total elements, padding included
  std::vector<int64_t> buckets;  // global bucket indices of this buffer, in offset order
};

struct BucketLayout {
  std::vector<BufferSpec> buffers;
  std::vector<BucketSpan> buckets;  // indexed by global bucket index = launch order
  std::vector<ParamSlot> slots;     // indexed by param index (registration order)
};

// Throws naming the param or field on: dp_size or expert_dp_size < 1, a negative numel, an empty name.
BucketLayout assign_buckets(const std::vector<ParamSpec>& params, const LayoutConfig& config);

// Rounds n up to a multiple of m (m >= 1).
constexpr int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

}  // namespace meshddp
