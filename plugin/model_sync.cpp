#include "plugin/model_sync.h"

#include "mesh/collectives.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <cstring>
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
  const int64_t n = group.getSize();
  // On the tensors' device: NCCL groups take only CUDA tensors, Gloo takes both.
  const c10::Device device = tensors.empty() ? c10::Device(c10::kCPU) : tensors.front().tensor.device();
  const auto long_options = at::TensorOptions().dtype(at::kLong).device(device);
  at::Tensor my_len = at::full({1}, static_cast<int64_t>(mine.size()), long_options);
  at::Tensor lens = at::zeros({n}, long_options);
  wait_collective(all_gather_into(group, lens, my_len, what + " check (sizes)"), group, what + " check");
  int64_t max_len = 1;
  for (int64_t r = 0; r < n; ++r) max_len = std::max(max_len, lens[r].item<int64_t>());
  at::Tensor my_bytes = at::zeros({max_len}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(my_bytes.data_ptr<uint8_t>(), mine.data(), mine.size());
  my_bytes = my_bytes.to(device);
  at::Tensor all_bytes = at::zeros({max_len * n}, at::TensorOptions().dtype(at::kByte).device(device));
  wait_collective(all_gather_into(group, all_bytes, my_bytes, what + " check (names)"), group, what + " check");

  std::vector<std::vector<std::string>> lists(n);
  all_bytes = all_bytes.cpu();
  lens = lens.cpu();
  for (int64_t r = 0; r < n; ++r) {
    const char* begin = reinterpret_cast<const char*>(all_bytes.data_ptr<uint8_t>()) + r * max_len;
    std::istringstream text(std::string(begin, lens[r].item<int64_t>()));
    for (std::string line; std::getline(text, line);) lists[r].push_back(line);
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
