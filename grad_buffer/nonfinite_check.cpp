// Non-finite gradients for GradBuffer: each bucket's local gradient is counted for NaN/Inf, by
// param, just before its collective (launch_bucket; the local values are gone after the
// collective), into device tensors (nonfinite_count.h: one read of the bucket, no host sync). The
// distributed optimizer reads the totals when it steps; with check_for_nan_in_grad, after the sync
// every rank agrees, through one all-reduce, to throw the same error naming the params. Raising on
// the rank that saw the NaN, before its collective, would leave its peers waiting in that collective
// until the timeout; reading the count per bucket would stall backward on the device (one host sync
// per bucket, as Megatron's check does).
#include "grad_buffer/grad_buffer.h"
#include "grad_buffer/run_stats.h"
#include "mesh/collectives.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <sstream>

namespace meshddp {
namespace {

// Note [Overflow in the reduction]
//   A comm hook reduces in its own dtype: under fp16_compress every rank can send a finite value
//   (1e5 pre-divided by 2 ranks: 5e4 < 65504) whose SUM overflows to inf. What is sent then counts
//   nothing, so with a hook other than "none" the reduced gradients are counted too, after the waits
//   (the whole bucket: under ZeRO-1 the other ranks' shards hold this rank's local values, finite
//   when nothing sent was non-finite), and reported when nothing sent was non-finite (else that
//   explains it).

// Each param's count, from per-piece counts (pieces in order, bucket after bucket).
std::vector<int64_t> counts_by_param(const at::Tensor& piece_counts, const std::vector<const NonfinitePieces*>& pieces,
                                     size_t num_params) {
  std::vector<int64_t> by_param(num_params, 0);
  const at::Tensor host = piece_counts.cpu();
  const int64_t* counts = host.const_data_ptr<int64_t>();
  for (const NonfinitePieces* bucket : pieces) {
    for (int64_t param : bucket->param) by_param[param] += *counts++;
  }
  return by_param;
}

}  // namespace

void GradBuffer::count_nonfinite(int64_t b, const at::Tensor& values) {
  BucketNonfinite& nonfinite = buckets_[b].nonfinite;
  nonfinite.piece_counts = count_nonfinite_pieces(values, nonfinite.offsets);
  // optim_grads: this step's earlier micro-batches, each reduced on its own (Note [Sharded gradients]).
  if (buckets_[b].carried_counts.defined())
    nonfinite.piece_counts = nonfinite.piece_counts + buckets_[b].carried_counts;
  nonfinite.total = nonfinite.piece_counts.sum();
}

std::vector<int64_t> GradBuffer::nonfinite_by_param() const {
  std::vector<int64_t> by_param(params_.size(), 0);
  std::vector<at::Tensor> counted;
  std::vector<const BucketNonfinite*> buckets;
  for (const Bucket& bucket : buckets_) {
    if (!bucket.nonfinite.piece_counts.defined()) continue;
    counted.push_back(bucket.nonfinite.piece_counts);
    buckets.push_back(&bucket.nonfinite);
  }
  if (counted.empty()) return by_param;
  const at::Tensor host = at::cat(counted).cpu();  // the one copy from the device
  const int64_t* counts = host.const_data_ptr<int64_t>();
  for (const BucketNonfinite* nonfinite : buckets) {
    for (int64_t param : nonfinite->pieces.param) by_param[param] += *counts++;
  }
  return by_param;
}

void GradBuffer::raise_if_nonfinite() {
  std::vector<at::Tensor> totals;
  for (const Bucket& bucket : buckets_) {
    if (bucket.nonfinite.total.defined()) totals.push_back(bucket.nonfinite.total);
  }
  const c10::Device device = layout_.buffers.empty() ? c10::Device(c10::kCPU) : layout_.buffers.front().key.device;
  const auto zero = [&] { return at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device)); };
  at::Tensor sent = totals.empty() ? zero() : at::stack(totals).sum().to(at::kDouble).reshape({1});
  // Note [Overflow in the reduction]: with a comm hook, the reduced values too.
  at::Tensor reduced = zero(), reduced_pieces;
  std::vector<const NonfinitePieces*> pieces;
  if (comm_hook_->name() != kNoCommHook && !buckets_.empty() && !shards_grads_) {  // optim_grads: blocks released
    std::vector<at::Tensor> counted;
    for (int64_t b = 0; b < static_cast<int64_t>(buckets_.size()); ++b) {
      counted.push_back(count_nonfinite_pieces(bucket_data(b), buckets_[b].nonfinite.offsets));
      pieces.push_back(&buckets_[b].nonfinite.pieces);
    }
    reduced_pieces = at::cat(counted);
    reduced = reduced_pieces.sum().to(at::kDouble).reshape({1});
  }
  // `total` lives until after the wait and the read (Note [Stream lifetimes of collective temporaries]).
  at::Tensor total = at::cat({sent, reduced});
  all_reduce_over_run(groups_, total, "the non-finite gradient check (check_for_nan_in_grad)");
  const at::Tensor host_total = total.cpu();  // the check's one host sync
  if (host_total[0].item<double>() == 0 && host_total[1].item<double>() == 0) return;
  if (host_total[0].item<double>() == 0) {
    const std::vector<int64_t> reduced_by_param = counts_by_param(reduced_pieces, pieces, params_.size());
    std::ostringstream mine;
    for (int64_t b = 0; b < static_cast<int64_t>(layout_.buckets.size()); ++b) {
      for (int64_t p : layout_.buckets[b].params) {
        if (reduced_by_param[p] == 0) continue;
        mine << "  " << describe_rank(groups_) << "): parameter '" << params_[p].name << "' has " << reduced_by_param[p]
             << " NaN/Inf value(s) of " << params_[p].param.numel() << " in its reduced gradient, in "
             << bucket_description(b) << "\n";
      }
    }
    std::ostringstream report;
    report << "GradBuffer: non-finite gradients at step " << syncs_completed_ - 1
           << " (check_for_nan_in_grad; step = finish_grad_sync() calls before this one): every rank sent finite "
              "values, but the reduced gradient overflowed in the dtype of comm hook '"
           << comm_hook_->name() << "' (the SUM over the DP ranks exceeds its range):\n";
    for (const std::string& lines :
         all_gather_over_run(groups_, mine.str(), "the non-finite gradient report", device)) {
      report << lines;
    }
    report << "Do not step the optimizer. Use comm_hook 'bf16_compress' (fp32's range) or 'none', or scale the "
              "loss down (the gradients are too large for the hook's dtype)";
    TORCH_CHECK(false, report.str());
  }
  const std::vector<int64_t> by_param = nonfinite_by_param();
  std::ostringstream mine;
  for (int64_t b = 0; b < static_cast<int64_t>(layout_.buckets.size()); ++b) {
    for (int64_t p : layout_.buckets[b].params) {
      if (by_param[p] == 0) continue;
      mine << "  " << describe_rank(groups_) << "): parameter '" << params_[p].name << "' has " << by_param[p]
           << " NaN/Inf gradient value(s) of " << params_[p].param.numel() << ", in " << bucket_description(b) << "\n";
    }
  }
  std::ostringstream report;
  report << "GradBuffer: non-finite gradients at step " << syncs_completed_ - 1
         << " (check_for_nan_in_grad; step = finish_grad_sync() calls before this one), found in the local "
            "gradients as sent to their collective (after the comm hook's cast, if any):\n";
  for (const std::string& lines : all_gather_over_run(groups_, mine.str(), "the non-finite gradient report", device)) {
    report << lines;
  }
  report << "The reduced gradients of these params are non-finite on every rank that holds them; do not step the "
            "optimizer. Look for a too-large "
            "learning rate, an overflow in that rank's forward/backward, or a bad batch on that rank";
  TORCH_CHECK(false, report.str());
}

}  // namespace meshddp
