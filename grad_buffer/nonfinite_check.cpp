// check_for_nan_in_grad for GradBuffer: each bucket's local gradient is counted for NaN/Inf just
// before its collective (grad_buffer.cpp launch_bucket), the params of a bucket with any are noted
// then (the local values are gone after the collective), and after the sync every rank agrees,
// through one all-reduce, to throw the same error. Raising on the rank that saw the NaN, before its
// collective, would leave its peers waiting in that collective until the timeout.
#include "grad_buffer/grad_buffer.h"

#include "mesh/collectives.h"

#include <ATen/ops/isfinite.h>
#include <ATen/ops/stack.h>
#include <c10/util/Exception.h>

#include <sstream>

namespace meshddp {

void GradBuffer::note_nonfinite_params(int64_t b) {
  // The one host sync of the check (a no-op wait on CPU, where the count is already known).
  if (nonfinite_counts_[b].item<int64_t>() == 0) return;
  std::ostringstream out;
  for (int64_t p : layout_.buckets[b].params) {
    const int64_t n = at::isfinite(main_grads_[p]).logical_not().sum().item<int64_t>();
    if (n == 0) continue;
    out << "  rank " << stats_group().getRank() << " (DP rank " << dp_rank() << "): parameter '" << params_[p].name
        << "' has " << n << " NaN/Inf gradient value(s) of " << main_grads_[p].numel() << ", in "
        << bucket_description(b) << "\n";
  }
  nonfinite_notes_[b] = out.str();
}

void GradBuffer::raise_if_nonfinite() {
  std::string mine;
  for (const auto& note : nonfinite_notes_) mine += note;
  at::Tensor total = at::stack(nonfinite_counts_).sum().to(at::kDouble).reshape({1});
  all_reduce_sum_now(stats_group(), total, "the non-finite gradient check (check_for_nan_in_grad)");
  if (total.item<double>() == 0) return;
  std::ostringstream report;
  report << "GradBuffer: non-finite gradients at step " << syncs_completed_ - 1
         << " (check_for_nan_in_grad; step = finish_grad_sync() calls before this one), found in the local "
            "gradients before their collective:\n";
  const c10::Device device = buffers_.empty() ? c10::Device(c10::kCPU) : buffers_.front().device();
  for (const std::string& lines : all_gather_strings(stats_group(), mine, "the non-finite gradient report", device)) {
    report << lines;
  }
  report << "The reduced gradients are non-finite on every rank; do not step the optimizer. Look for a too-large "
            "learning rate, an overflow in that rank's forward/backward, or a bad batch on that rank";
  TORCH_CHECK(false, report.str());
}

}  // namespace meshddp
