#include "plugin/model_sync.h"

#include "mesh/collectives.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <sstream>

namespace meshddp {
namespace {

std::string describe_tensor(const NamedTensor& t) {
  std::ostringstream out;
  out << "'" << t.name << "' " << t.tensor.scalar_type() << " " << t.tensor.sizes()
      << (t.tensor.requires_grad() ? " trainable" : " frozen");
  return out.str();
}

// Each rank's list as text, one entry per line, gathered to every rank.
std::vector<std::vector<std::string>> gather_descriptions(c10d::ProcessGroup& group,
                                                          const std::vector<NamedTensor>& tensors,
                                                          const std::string& what) {
  std::string mine;
  for (const auto& t : tensors) mine += describe_tensor(t) + "\n";
  // On the tensors' device: NCCL groups take only CUDA tensors, Gloo takes both.
  const c10::Device device = tensors.empty() ? c10::Device(c10::kCPU) : tensors.front().tensor.device();
  std::vector<std::vector<std::string>> lists;
  for (const std::string& text : all_gather_strings(group, mine, what + " check", device)) {
    lists.emplace_back();
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);) lists.back().push_back(line);
  }
  return lists;
}

}  // namespace

void verify_same_tensors_across_ranks(c10d::ProcessGroup& dp_group, const std::vector<NamedTensor>& tensors,
                                      const std::string& what, const std::vector<int64_t>& global_ranks) {
  const auto lists = gather_descriptions(dp_group, tensors, what);
  auto rank_name = [&](size_t r) {
    std::ostringstream out;
    out << "DP rank " << r;
    if (r < global_ranks.size()) out << " (global rank " << global_ranks[r] << ")";
    return out.str();
  };
  for (size_t r = 1; r < lists.size(); ++r) {
    const auto& ref = lists[0];
    const auto& other = lists[r];
    for (size_t i = 0; i < std::max(ref.size(), other.size()); ++i) {
      const std::string expected = i < ref.size() ? ref[i] : "(nothing)";
      const std::string actual = i < other.size() ? other[i] : "(nothing)";
      TORCH_CHECK(expected == actual, "DistributedDataParallel: the model differs across data-parallel ranks: ", what,
                  " #", i, " is ", expected, " on ", rank_name(0), " but ", actual, " on ", rank_name(r), " (",
                  ref.size(), " vs ", other.size(), " ", what,
                  "s in all). Build the same model, in the same registration order, on every rank");
    }
  }
}

// Note [Broadcast without staging copies]
// A tensor of at least chunking.in_place_bytes is broadcast in place (one collective, no copy); smaller
// ones of one (dtype, device) are packed into chunks of at most chunking.chunk_bytes, one collective per
// chunk. Rank 0 packs its values; the others receive into an empty chunk and copy out, so no rank ever
// holds a copy of all the tensors (peak: one chunk) and rank 0 copies nothing back. The split depends on
// sizes and dtypes only, which every rank agrees on, so every rank launches the same collectives.
void broadcast_from_group_rank0(c10d::ProcessGroup& group, const std::vector<NamedTensor>& tensors,
                                const std::string& what, const BroadcastChunking& chunking) {
  if (skip_collective(group) || tensors.empty()) return;
  c10::NoGradGuard no_grad;
  const bool root = group.getRank() == 0;
  // Broadcasts `sent` and waits; then, on the receiving ranks, copies its values out to `targets`
  // (packed one after the other).
  auto broadcast_and_unpack = [&](const at::Tensor& sent, const std::vector<at::Tensor>& targets) {
    wait_collective(broadcast_from(group, sent, 0, what), group, what);
    if (root) return;
    int64_t offset = 0;
    for (const auto& m : targets) {
      m.copy_(sent.narrow(0, offset, m.numel()).view(m.sizes()));
      offset += m.numel();
    }
  };
  std::vector<Work> in_place;  // launched together, waited at the end
  // Small tensors, grouped by (dtype, device) so that each chunk is one flat broadcast.
  std::map<std::pair<int, std::string>, std::vector<at::Tensor>> small;
  for (const auto& t : tensors) {
    const at::Tensor tensor = t.tensor.detach();
    if (static_cast<int64_t>(tensor.nbytes()) < chunking.in_place_bytes) {
      small[{static_cast<int>(tensor.scalar_type()), tensor.device().str()}].push_back(tensor);
    } else if (tensor.is_contiguous()) {
      in_place.push_back(broadcast_from(group, tensor, 0, what));
    } else {
      broadcast_and_unpack(tensor.contiguous().view({-1}), {tensor});
    }
  }
  for (auto& [key, members] : small) {
    for (size_t first = 0; first < members.size();) {
      size_t end = first + 1;
      int64_t bytes = static_cast<int64_t>(members[first].nbytes());
      int64_t numel = members[first].numel();
      for (; end < members.size(); ++end) {
        const auto next = static_cast<int64_t>(members[end].nbytes());
        if (bytes + next > chunking.chunk_bytes) break;
        bytes += next;
        numel += members[end].numel();
      }
      const std::vector<at::Tensor> chunk(members.begin() + static_cast<std::ptrdiff_t>(first),
                                          members.begin() + static_cast<std::ptrdiff_t>(end));
      at::Tensor packed;
      if (root) {
        std::vector<at::Tensor> flat;
        for (const auto& m : chunk) flat.push_back(m.reshape({-1}));
        packed = at::cat(flat);
      } else {
        packed = at::empty({numel}, chunk.front().options());
      }
      broadcast_and_unpack(packed, chunk);
      first = end;
    }
  }
  for (const Work& work : in_place) wait_collective(work, group, what);
}

void broadcast_changed_from_group_rank0(c10d::ProcessGroup& group, const std::vector<NamedTensor>& tensors,
                                        const std::string& what) {
  if (skip_collective(group) || tensors.empty()) return;
  c10::NoGradGuard no_grad;
  std::vector<NamedTensor> copies;
  copies.reserve(tensors.size());
  for (const auto& t : tensors) copies.push_back({t.name, t.tensor.detach().contiguous().clone()});
  broadcast_from_group_rank0(group, copies, what);
  if (group.getRank() == 0) return;
  const auto bytes = [](const at::Tensor& t) { return t.contiguous().reshape({-1}).view(at::kByte); };
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor target = tensors[i].tensor.detach();
    if (!at::equal(bytes(target), bytes(copies[i].tensor))) target.copy_(copies[i].tensor);
  }
}

namespace {

// Sum of the elements' bit patterns, as int64 (wrapping): equal tensors give equal sums, and any
// single changed bit changes it. Order-free, so no rounding can make two identical tensors differ.
at::Tensor bit_checksum(const at::Tensor& t) {
  const at::Tensor flat = t.detach().contiguous().reshape({-1});
  switch (flat.element_size()) {
    case 1:
      return flat.view(at::kByte).sum(at::kLong);
    case 2:
      return flat.view(at::kShort).sum(at::kLong);
    case 4:
      return flat.view(at::kInt).sum(at::kLong);
    default:
      return flat.view(at::kLong).sum(at::kLong);
  }
}

}  // namespace

void verify_tp_replicas_identical(c10d::ProcessGroup& tp_group, const std::vector<NamedTensor>& tensors, int64_t step) {
  const int64_t tp = tp_group.getSize();
  if (tp == 1 || tensors.empty()) return;
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> sums;
  for (const auto& t : tensors) sums.push_back(bit_checksum(t.tensor).reshape({1}));
  const at::Tensor mine = at::cat(sums);
  at::Tensor all = at::empty({tp * mine.numel()}, mine.options());
  const std::string what = "the TP-replica check of step " + std::to_string(step);
  wait_collective(all_gather_into(tp_group, all, mine, what), tp_group, what);
  const at::Tensor table = all.cpu().view({tp, mine.numel()});
  const auto* v = table.data_ptr<int64_t>();
  const int64_t n = mine.numel();
  for (int64_t i = 0; i < n; ++i) {
    bool same = true;
    for (int64_t r = 1; r < tp; ++r) same = same && v[r * n + i] == v[i];
    if (same) continue;
    std::ostringstream checksums;
    for (int64_t r = 0; r < tp; ++r) checksums << (r ? ", " : "") << "TP rank " << r << ": " << v[r * n + i];
    TORCH_CHECK(false, "DistributedDataParallel: parameter '", tensors[i].name,
                "' is replicated over TP but its copies ", "differ across the TP ranks of ", describe_group(tp_group),
                " at step ", step, " (bit checksums ", checksums.str(),
                "). Most likely its gradient is partial over TP (a norm or bias applied to sequence-",
                "sharded activations under sequence parallelism) and nothing sums it: give its module the ",
                "SequenceParallelNorm plan style, or call meshddp::declare_sequence_parallel_param() on it before ",
                "wrapping the model. (DdpConfig::tp_replica_check_interval sets how often this is checked)");
  }
}

}  // namespace meshddp
