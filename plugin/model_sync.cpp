#include "plugin/model_sync.h"

#include "mesh/collectives.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

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
std::vector<std::vector<std::string>> gather_descriptions(c10d::ProcessGroup& group, const std::vector<NamedTensor>& tensors,
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
      TORCH_CHECK(expected == actual, "DistributedDataParallel: the model differs across data-parallel ranks: ",
                  what, " #", i, " is ", expected, " on ", rank_name(0), " but ", actual, " on ", rank_name(r), " (",
                  ref.size(), " vs ", other.size(), " ", what,
                  "s in all). Build the same model, in the same registration order, on every rank");
    }
  }
}

void broadcast_from_dp_rank0(c10d::ProcessGroup& dp_group, const std::vector<NamedTensor>& tensors) {
  if (dp_group.getSize() == 1 || tensors.empty()) return;
  c10::NoGradGuard no_grad;
  // Group by (dtype, device) so each group is one flat broadcast.
  std::map<std::pair<int, std::string>, std::vector<at::Tensor>> groups;
  for (const auto& t : tensors) {
    groups[{static_cast<int>(t.tensor.scalar_type()), t.tensor.device().str()}].push_back(t.tensor);
  }
  for (auto& [key, members] : groups) {
    std::vector<at::Tensor> flat;
    for (const auto& m : members) flat.push_back(m.detach().reshape({-1}));
    at::Tensor packed = at::cat(flat);
    wait_collective(broadcast_from(dp_group, packed, 0, "the initial parameters and buffers"), dp_group,
                    "the initial parameters and buffers");
    int64_t offset = 0;
    for (auto& m : members) {
      m.detach().copy_(packed.narrow(0, offset, m.numel()).view(m.sizes()));
      offset += m.numel();
    }
  }
}

}  // namespace meshddp
