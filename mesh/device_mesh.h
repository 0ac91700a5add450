// DeviceMesh: an N-D grid of ranks with named dims (row-major, last dim innermost) that gives this
// rank its coordinates, one c10d process group per dim, and on demand the groups over flattened sets
// of dims (DP x CP) or any partition of its ranks (expert parallel, optimizer instances:
// mesh/reduction_groups.h). Gloo groups for CPU meshes, NCCL for CUDA meshes. It builds groups only;
// collectives go through mesh/collectives.h.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace meshddp {

// A partition of ranks into groups (mesh/reduction_groups.h makes and checks them; the same alias).
using RankGroups = std::vector<std::vector<int64_t>>;

struct MeshOptions {
  // kCPU: Gloo groups, tensors on the CPU. kCUDA: NCCL groups, device cuda:LOCAL_RANK (needs a
  // build with CUDA). Multi-rank CUDA tensors on one GPU: use kCPU groups (Gloo takes CUDA tensors).
  c10::DeviceType device_type = c10::DeviceType::CPU;
  // How long a collective or a rendezvous may wait before it fails with an error instead of hanging.
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
  // A rank that has waited this long for a collective prints a line naming the group, what the
  // collective is for (e.g. the bucket) and the ranks that have not reached it, then again each
  // time the wait doubles, until `timeout`. 0 = off. Meshes from a store only (from_env,
  // from_store): the launch counts live in it (mesh/collective_progress.h).
  std::chrono::milliseconds stuck_report_after = std::chrono::seconds(30);
  // Store prefix under which this mesh's groups rendezvous; give two meshes on one store
  // different prefixes.
  std::string store_prefix = "meshddp";
  // CUDA meshes: this rank's GPU. -1 = LOCAL_RANK (torchrun sets it), or rank % visible GPUs when
  // that is unset. The mesh makes it the current device once, before any group exists.
  int64_t device_index = -1;
};

class DeviceMesh {
 public:
  // From torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK for
  // CUDA). Rank 0 hosts the TCPStore unless TORCHELASTIC_USE_AGENT_STORE=True, in which case every
  // rank joins the store torchrun's agent already serves. Throws naming a missing variable.
  static DeviceMesh from_env(std::vector<int64_t> sizes, std::vector<std::string> names, MeshOptions options = {});

  // From a store the caller gives (tests: one HashStore shared by rank threads, or a FileStore).
  // Every rank must call this concurrently: group construction blocks until its peers join.
  static DeviceMesh from_store(c10::intrusive_ptr<c10d::Store> store, int64_t rank, int64_t world_size,
                               std::vector<int64_t> sizes, std::vector<std::string> names, MeshOptions options = {});

  // From process groups the caller already has, one per dim, in dim order. Checks that each group's
  // size is its dim's size and that its rank is this rank's coordinate along that dim. For kCUDA,
  // `device_index` picks this rank's GPU as MeshOptions::device_index does, and it becomes the
  // current device.
  static DeviceMesh from_groups(std::vector<int64_t> sizes, std::vector<std::string> names, int64_t rank,
                                std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups_by_dim,
                                c10::DeviceType device_type = c10::DeviceType::CPU,
                                c10::intrusive_ptr<c10d::ProcessGroup> world = {}, int64_t device_index = -1);

  // This rank's process group along `dim` (e.g. mesh["dp"]). Throws on an unknown dim name.
  const c10::intrusive_ptr<c10d::ProcessGroup>& operator[](std::string_view dim) const;
  // The group of every rank of the mesh (e.g. DP x TP): gradients partial over TP are summed over it
  // (pre-divided by DP), and gradient norms reduced. Same as the only dim's group for a 1-D mesh.
  // Null if the mesh was built from_groups() without one.
  const c10::intrusive_ptr<c10d::ProcessGroup>& world() const { return world_; }

  int64_t rank() const { return rank_; }
  int64_t world_size() const { return world_size_; }
  int64_t ndim() const { return static_cast<int64_t>(sizes_.size()); }
  int64_t size(std::string_view dim) const;
  int64_t coordinate(std::string_view dim) const;
  const std::vector<int64_t>& sizes() const { return sizes_; }
  const std::vector<std::string>& names() const { return names_; }
  const std::vector<int64_t>& coordinates() const { return coords_; }
  // Global ranks of this rank's group along `dim`, in group-rank order.
  std::vector<int64_t> group_ranks(std::string_view dim) const;
  // This rank's group over the flattened `dims` (torch's mesh["dp", "cp"]._flatten()), its ranks in
  // flattened_ranks(dims) order: what a parameter replicated over those dims is reduced over. One
  // dim: that dim's group (mesh[dim]); every dim: world(). Otherwise made at the first call for
  // these dims and cached; copies of the mesh share the cache. Throws on bad dims (unknown,
  // repeated, not in mesh order). The first call for a set of dims is collective over the whole
  // mesh (Note [Groups made on demand] in device_mesh.cpp): every rank makes it, in the same order.
  c10::intrusive_ptr<c10d::ProcessGroup> flattened(const std::vector<std::string>& dims) const;
  // Global ranks of this rank's group over the flattened `dims`, in group-rank order.
  std::vector<int64_t> flattened_ranks(const std::vector<std::string>& dims) const;
  // This rank's group out of `groups`, a partition of the mesh's ranks (e.g.
  // expert_parallel_groups(), optimizer_instance_groups() of mesh/reduction_groups.h) that `name`
  // names (e.g. "ep"): made at the first call with that name, cached after. Collective at the first
  // call like flattened(); every rank must pass the same `groups` (checked: a mismatch fails on every
  // rank naming rank 0's groups and the differing rank's). Throws if `groups` is not a partition of
  // the mesh's ranks, if `name` was used before with other groups, or if the mesh has no store to make
  // groups over (from_groups() without a world group that has one).
  c10::intrusive_ptr<c10d::ProcessGroup> group_of(const std::string& name, const RankGroups& groups) const;
  // Device this rank computes on: CPU, or cuda:<index> for CUDA meshes (MeshOptions::device_index).
  c10::Device device() const { return device_; }
  // "dp(2) x tp(2), rank 3 at (dp=1, tp=1)".
  std::string describe() const;

 private:
  struct DerivedGroups;  // the store and options to make groups with, and the groups made (device_mesh.cpp)
  DeviceMesh() = default;
  // This rank's group of `ranks` (which hold this rank), made over the store and warmed up.
  c10::intrusive_ptr<c10d::ProcessGroup> make_derived_group(const std::string& name,
                                                            const std::vector<int64_t>& ranks) const;
  std::vector<int64_t> sizes_;
  std::vector<std::string> names_;
  std::vector<int64_t> coords_;
  int64_t rank_ = 0;
  int64_t world_size_ = 1;
  c10::Device device_{c10::DeviceType::CPU};
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups_;
  c10::intrusive_ptr<c10d::ProcessGroup> world_;
  std::shared_ptr<DerivedGroups> derived_;
};

}  // namespace meshddp
