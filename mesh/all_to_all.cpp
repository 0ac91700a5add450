#include "mesh/all_to_all.h"

#include "mesh/collective_progress.h"
#include "mesh/collectives.h"
#include "mesh/switches.h"

#include <ATen/ops/empty.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <numeric>
#include <sstream>

namespace meshddp {
namespace {

std::string prefix(const c10d::ProcessGroup& group, const std::string& what) {
  return "meshddp all-to-all of " + what + " on " + describe_group(group) + ": ";
}

void check_splits(const c10d::ProcessGroup& group, const std::vector<int64_t>& splits, const at::Tensor& t,
                  const char* role, const std::string& what) {
  TORCH_CHECK(static_cast<int64_t>(splits.size()) == group.getSize(), prefix(group, what), role, " splits have ",
              splits.size(), " entries, expected one per group rank (", group.getSize(), ")");
  int64_t total = 0;
  for (int64_t s : splits) {
    TORCH_CHECK(s >= 0, prefix(group, what), role, " splits ", c10::IntArrayRef(splits), " contain a negative size");
    total += s;
  }
  TORCH_CHECK(t.dim() >= 1 && total == t.size(0), prefix(group, what), role, " splits ", c10::IntArrayRef(splits),
              " sum to ", total, " rows, but the ", role, " tensor has sizes ", t.sizes());
}

// MESHDDP_DEBUG_SYNC: every rank's splits on every rank, then the same verdict everywhere: what rank i
// sends to rank j (its input_splits[j]) must be what j expects from i (its output_splits[i]). Splits
// that fit each rank's tensors but disagree across ranks are otherwise caught by no check: Gloo aborts
// the receiving process from its own thread ("Received data size doesn't match expected size"), NCCL
// hangs or reads garbage.
void check_splits_agree(c10d::ProcessGroup& group, const std::vector<int64_t>& output_splits,
                        const std::vector<int64_t>& input_splits, const c10::Device& device, const std::string& what) {
  std::ostringstream mine;
  for (int64_t s : input_splits) mine << s << ' ';
  for (int64_t s : output_splits) mine << s << ' ';
  const auto all =
      all_gather_strings(group, mine.str(), "the MESHDDP_DEBUG_SYNC check of the all-to-all of " + what, device);
  const auto n = static_cast<size_t>(group.getSize());
  std::vector<std::vector<int64_t>> in(n, std::vector<int64_t>(n)), out(n, std::vector<int64_t>(n));
  for (size_t r = 0; r < n; ++r) {
    std::istringstream words(all[r]);
    for (auto& v : in[r]) words >> v;
    for (auto& v : out[r]) words >> v;
  }
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < n; ++j) {
      TORCH_CHECK(in[i][j] == out[j][i], prefix(group, what), "group rank ", i, " sends ", in[i][j],
                  " rows to group rank ", j, " (its input splits ", c10::IntArrayRef(in[i]), "), but rank ", j,
                  " expects ", out[j][i], " from it (its output splits ", c10::IntArrayRef(out[j]),
                  "); every rank's output_splits[i] must be rank i's input_splits for it (exchange the counts ",
                  "first, e.g. all_to_all_counts) (this is group rank ", group.getRank(), ")");
    }
  }
}

}  // namespace

Work all_to_all_rows(c10d::ProcessGroup& group, const at::Tensor& output, const at::Tensor& input,
                     const std::vector<int64_t>& output_splits, const std::vector<int64_t>& input_splits,
                     const std::string& what) {
  for (const auto& [t, role] : {std::pair{output, "output"}, std::pair{input, "input"}}) {
    TORCH_CHECK(t.defined() && t.layout() == c10::kStrided && t.is_contiguous(), prefix(group, what), role,
                " tensor must be defined, dense and contiguous");
  }
  TORCH_CHECK(input.scalar_type() == output.scalar_type() && input.device() == output.device() &&
                  input.dim() == output.dim() && input.sizes().slice(1) == output.sizes().slice(1),
              prefix(group, what), "input ", input.sizes(), " ", input.scalar_type(), " on ", input.device(),
              " and output ", output.sizes(), " ", output.scalar_type(), " on ", output.device(),
              " must share dtype, device and row shape (sizes after dim 0)");
  check_splits(group, output_splits, output, "output", what);
  check_splits(group, input_splits, input, "input", what);
  if (switch_on(Switch::kDebugSync)) check_splits_agree(group, output_splits, input_splits, input.device(), what);
  at::Tensor out = output, in = input;
  std::vector<int64_t> out_splits = output_splits, in_splits = input_splits;
  Work work = group.alltoall_base(out, in, out_splits, in_splits, c10d::AllToAllOptions());
  note_collective_launch(group, work, "all-to-all of " + what);
  return work;
}

at::Tensor all_to_all_counts(c10d::ProcessGroup& group, const at::Tensor& counts, const std::string& what) {
  const int64_t n = group.getSize();
  TORCH_CHECK(counts.dim() == 1 && counts.scalar_type() == at::kLong && counts.numel() % n == 0, prefix(group, what),
              "counts must be a 1-D int64 tensor whose size divides by the group size ", n, "; got ", counts.sizes(),
              " ", counts.scalar_type());
  const at::Tensor in = counts.contiguous();
  at::Tensor out = at::empty_like(in);
  const std::vector<int64_t> splits(static_cast<size_t>(n), in.numel() / n);
  wait_collective(all_to_all_rows(group, out, in, splits, splits, what), group, "all-to-all of " + what);
  return out;
}

}  // namespace meshddp
