// Params tied across pipeline stages (mesh/pipeline_groups.h: declare_tied_across_stages): their own
// buffer and buckets (BufferKey::tied), summed over the embedding group before the DP reduction.
#include "grad_buffer/bucket_reduction.h"
#include "grad_buffer/grad_buffer.h"
#include "mesh/collectives.h"

#include <c10/util/Exception.h>

namespace meshddp {

// Note [Tied across stages]
// The token embedding on the first stage and the LM head on the last are one weight in the model
// that one process trains: its gradient is the sum of both uses. Each copy's slot holds one use's
// local gradient; the bucket (only tied params: a buffer of its own, so its layout is the tied params
// alone, the same on both stages whatever else each stage holds) is pre-divided by D like any bucket,
// SUM all-reduced over the embedding group (first and last stage of this pipeline), then reduced over
// DP (all-reduce, or ZeRO-1's reduce-scatter) as a dense bucket. Summing before the DP reduction is
// what lets the two sides shard differently elsewhere: after a reduce-scatter each rank holds only
// its shard, and a sum of shards is only right when both stages lay the bucket out alike (the
// Megatron-core regression where the tied param came first on one stage and last on the other). The
// embedding sum is launched with the bucket (async: a stage blocked in a backward hook waiting for
// the other would deadlock the pipeline, whose first stage still needs the last stage's gradients)
// and waited in finish_grad_sync(), where the DP reduction is then launched, in bucket order on every
// DP rank alike. Both copies then hold bit-identical gradients, and the same optimizer step keeps
// them identical.

void check_tied_param(const NamedParam& p, const Placement& placement, const SyncGroups& groups) {
  TORCH_CHECK(groups.embedding, "GradBuffer: parameter ", describe_param_name(p),
              " is declared tied across pipeline stages (declare_tied_across_stages) but this buffer has no ",
              "embedding group to sum its two copies over; build DistributedDataParallel over a DeviceMesh with a '",
              "pp' dim (it makes the group), or give the group (SyncGroups::embedding, Python embedding_group=)");
  TORCH_CHECK(!is_expert_param(p.param), "GradBuffer: parameter ", describe_param_name(p),
              " is declared both an expert param and tied across pipeline stages; a tied weight is dense");
  TORCH_CHECK(!placement.is_partial_grad(), "GradBuffer: parameter ", describe_param_name(p),
              " is tied across pipeline stages and its gradient is partial over TP (", placement.str(),
              "); meshddp does not sum a TP-partial tied gradient over both the embedding group and TP");
}

void GradBuffer::launch_tied_sum(int64_t b, const at::Tensor& data) {
  Bucket& bucket = buckets_[b];
  c10d::ProcessGroup& group = *bucket.reduction.tied_group;
  if (skip_collective(group)) return launch_reduction(b);  // one stage: nothing to sum over
  bucket.tied_work = all_reduce_sum(group, data, bucket_description(b) + ": the sum of the copies tied across stages");
}

void GradBuffer::finish_tied_sum(int64_t b) {
  Bucket& bucket = buckets_[b];
  auto work = std::move(bucket.tied_work);
  bucket.tied_work.reset();
  wait_collective(work, *bucket.reduction.tied_group,
                  bucket_description(b) + ": the sum of the copies tied across stages");
  launch_reduction(b);
}

}  // namespace meshddp
