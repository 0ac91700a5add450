#include "mesh/all_to_all.h"

#include "mesh/collective_progress.h"

#include <ATen/ops/empty.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <numeric>

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
