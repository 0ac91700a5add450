// The one list of DdpConfig's fields (GradBufferConfig's included), in declaration order. It drives
// DdpConfig::validate()'s range checks, the cross-rank agreement of the settings at construction,
// and the Python package's DdpConfig keywords, properties and __repr__ (plugin/python). A field
// added to DdpConfig or GradBufferConfig must be added here: the static_assert below says so.
#pragma once

#include "../mesh/config_fields.h"
#include "distributed_data_parallel.h"

#include <tuple>

namespace meshddp {

inline constexpr auto kDdpConfigFields =
    std::make_tuple(field("bucket_bytes", &DdpConfig::bucket_bytes),  // upper bound: GradBufferConfig::validate()
                    field("overlap_grad_reduce", &DdpConfig::overlap_grad_reduce),
                    field("grad_reduce_in_fp32", &DdpConfig::grad_reduce_in_fp32),
                    field("pad_for_reduce_scatter", &DdpConfig::pad_for_reduce_scatter),
                    field("find_unused_parameters", &DdpConfig::find_unused_parameters),
                    field("use_distributed_optimizer", &DdpConfig::use_distributed_optimizer),
                    field("gradient_accumulation_fusion", &DdpConfig::gradient_accumulation_fusion),
                    field("check_for_nan_in_grad", &DdpConfig::check_for_nan_in_grad),
                    field("comm_hook", &DdpConfig::comm_hook),  // a built-in hook's name: GradBufferConfig::validate()
                    field("num_distributed_optimizer_instances", &DdpConfig::num_distributed_optimizer_instances),
                    field("shard_policy", &DdpConfig::shard_policy),  // "byte_range" | "whole_param": validate()
                    // "" | "no_shard" | "optim" | "optim_grads" | "optim_grads_params": validate(), check_combination()
                    field("data_parallel_sharding_strategy", &DdpConfig::data_parallel_sharding_strategy),
                    // comma-separated module globs ("" = top-level children and list elements): validate()
                    field("fsdp_unit_modules", &DdpConfig::fsdp_unit_modules),
                    field("broadcast_from_rank0", &DdpConfig::broadcast_from_rank0),
                    field("verify_model_across_ranks", &DdpConfig::verify_model_across_ranks),
                    field("broadcast_buffers", &DdpConfig::broadcast_buffers),
                    field("tp_replica_check_interval", &DdpConfig::tp_replica_check_interval, kNonNegative),
                    field("expert_parallel_size", &DdpConfig::expert_parallel_size, FieldRange{1.0, false}),
                    field("virtual_pipeline_size", &DdpConfig::virtual_pipeline_size, FieldRange{1.0, false}),
                    field("virtual_pipeline_chunk", &DdpConfig::virtual_pipeline_chunk, kNonNegative));

// DdpConfig counts its GradBufferConfig base as one initializer.
static_assert(std::tuple_size_v<decltype(kDdpConfigFields)> ==
                  aggregate_field_count<GradBufferConfig>() + aggregate_field_count<DdpConfig>() - 1,
              "a field of DdpConfig or GradBufferConfig is missing from kDdpConfigFields (plugin/ddp_config_fields.h): "
              "add it there so it is validated, agreed across ranks, settable from Python and shown by repr");

}  // namespace meshddp
