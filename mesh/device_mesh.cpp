#include "mesh/device_mesh.h"

#include "mesh/collective_progress.h"
#include "mesh/collectives.h"
#include "mesh/launch_round.h"
#include "mesh/mesh_layout.h"
#include "mesh/process_group_factory.h"
#include "mesh/reduction_groups.h"
#include "mesh/switches.h"

#include <ATen/ops/ones.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>
#include <string_view>
#include <utility>

#ifdef MESHDDP_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace meshddp {
namespace {

std::string require_env(const char* name, const char* what) {
  const char* value = std::getenv(name);
  TORCH_CHECK(value != nullptr && *value != '\0', "DeviceMesh::from_env: environment variable ", name, " (", what,
              ") is not set; launch with torchrun (e.g. torchrun --nproc-per-node 4 --no-python ",
              "<binary>), or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT yourself");
  return value;
}

int64_t require_int_env(const char* name, const char* what) {
  const std::string text = require_env(name, what);
  try {
    size_t used = 0;
    const int64_t value = std::stoll(text, &used);
    if (used == text.size()) return value;
  } catch (const std::exception&) {
  }
  TORCH_CHECK(false, "DeviceMesh::from_env: environment variable ", name, "='", text, "' is not an integer");
}

// Note [Mesh shape agreement]: ranks that disagree on the mesh shape would wait for different
// groups' rendezvous until the store timeout (10 minutes) and then name neither shape. So before
// any group exists, every rank compares its shape with rank 0's through the store and then meets
// the others at a store barrier; if any rank differs, every rank fails at once naming both shapes.
// A per-rank call counter keys each mesh built on the same store and prefix apart. group_of() checks
// its groups the same way (agree_through_store, under a key of its own).
void agree_through_store(c10d::Store& store, const std::string& prefix, int64_t rank, int64_t world_size,
                         const std::string& value, const std::string& what, const std::string& advice) {
  const int64_t generation = store.add(prefix + "/calls/" + std::to_string(rank), 1);
  const std::string base = prefix + "/" + std::to_string(generation) + "/";
  if (rank == 0) store.set(base + "rank0", value);
  store.wait({base + "rank0"});
  const auto ref_bytes = store.get(base + "rank0");
  const std::string ref(ref_bytes.begin(), ref_bytes.end());
  if (ref != value) store.set(base + "mismatch", "rank " + std::to_string(rank) + " has " + value);
  if (store.add(base + "arrived", 1) == world_size) store.set(base + "all_arrived", "1");
  store.wait({base + "all_arrived"});
  if (!store.check({base + "mismatch"})) return;
  const auto bytes = store.get(base + "mismatch");
  TORCH_CHECK(false, "DeviceMesh: the ranks disagree on ", what, ": rank 0 has ", ref, ", ",
              std::string(bytes.begin(), bytes.end()), " (this is rank ", rank, ": ", value, "). ", advice);
}

void agree_on_mesh_shape(c10d::Store& store, const std::string& prefix, int64_t rank, int64_t world_size,
                         const std::string& shape) {
  agree_through_store(store, prefix + "/mesh_shape", rank, world_size, shape, "the mesh shape",
                      "Give every rank the same sizes and dim names");
}

std::string describe_rank_groups(const RankGroups& groups) {
  std::string out;
  for (const auto& group : groups) out += "[" + describe_ranks(group) + "]";
  return out;
}

// Note [CUDA device of a rank]
// Every rank of a CUDA mesh computes on one GPU: MeshOptions::device_index, else LOCAL_RANK, else
// rank % visible GPUs (cuda_device_index, mesh_layout.h). The mesh makes it the current device
// (c10::cuda::set_device) once, before it creates any NCCL group: ProcessGroupNCCL, the caching
// allocator and the kernels of the fused step use the current device, and without this every rank
// of a node would land on GPU 0 (NCCL then fails on duplicate GPUs). The CPU build has no CUDA
// meshes (make_process_group refuses them), so it needs nothing here.
c10::Device cuda_device_of_rank(int64_t requested, int64_t rank) {
#ifdef MESHDDP_WITH_CUDA
  const int64_t index = cuda_device_index(requested, std::getenv("LOCAL_RANK"), rank, c10::cuda::device_count());
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(index));
  return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(index));
#else
  TORCH_CHECK(false, "DeviceMesh: a CUDA mesh, but meshddp was built without CUDA (no nvcc at configure time); ",
              "build with nvcc or use a CPU mesh");
#endif
}

}  // namespace

// Note [Groups made on demand]
// Groups beyond the per-dim ones (flattened dims, expert parallel, optimizer instances) are made when
// first asked for, over the mesh's store, each under its own key (store_prefix + "/derived/" +
// "<name>/ranks=..."), with a Gloo backend for CPU tensors like every mesh group, NCCL for CUDA
// tensors on a CUDA mesh (split from the world group when the mesh splits), a progress record, and a
// warm-up all-reduce. Every rank of the mesh takes part in each first request, in the same order:
// the ranks first check through the store that they all pass the same groups (agree_through_store;
// ranks asking for different groups would otherwise wait at different rendezvous until the timeout),
// which is a barrier over the whole mesh, and an NCCL split is collective over the world group
// anyway. A group is made once: later requests with the same name and groups return it. A mesh from
// from_groups() makes them over its world group's store, without progress records or NCCL splits.
struct DeviceMesh::DerivedGroups {
  c10::intrusive_ptr<c10d::Store> store;  // null: no store to make groups over
  MeshOptions options;
  bool nccl_split = false;       // split CUDA groups from the world group (Note [NCCL communicator set-up])
  bool record_progress = false;  // register each group for stuck reports (meshes from a store)
  std::mutex mutex;
  std::map<std::string, std::pair<RankGroups, c10::intrusive_ptr<c10d::ProcessGroup>>> by_name;
};

DeviceMesh DeviceMesh::from_env(std::vector<int64_t> sizes, std::vector<std::string> names, MeshOptions options) {
  const int64_t rank = require_int_env("RANK", "this process's global rank");
  const int64_t world_size = require_int_env("WORLD_SIZE", "number of ranks");
  const std::string host = require_env("MASTER_ADDR", "host of rank 0's TCPStore");
  const int64_t port = require_int_env("MASTER_PORT", "port of rank 0's TCPStore");
  validate_mesh(sizes, names, world_size, rank);
  TORCH_CHECK(port > 0 && port < 65536, "DeviceMesh::from_env: MASTER_PORT=", port, " is not a TCP port");
  // torchrun's agent already serves a store at MASTER_PORT when it says so; rank 0 must not bind again.
  const bool use_agent_store = store_outlives_launch();

  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(port);
  store_options.isServer = rank == 0 && !use_agent_store;
  store_options.numWorkers = use_agent_store ? std::nullopt : std::optional<size_t>(world_size);
  store_options.waitWorkers = !use_agent_store;
  store_options.timeout = options.timeout;
  c10::intrusive_ptr<c10d::TCPStore> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(host, store_options);
  } catch (const c10::Error& e) {  // c10d's DistNetworkError / DistStoreError: name what to check
    const std::string where = c10::str("MASTER_ADDR=", host, " MASTER_PORT=", port);
    std::string cause = e.what_without_backtrace();
    while (!cause.empty() && (cause.back() == '.' || cause.back() == '\n')) cause.pop_back();
    TORCH_CHECK(!store_options.isServer, "DeviceMesh::from_env: rank 0 of ", world_size,
                " cannot serve the TCPStore on ", where, ": ", cause,
                ". A port in use: pick a free MASTER_PORT (torchrun --standalone picks one). Ranks that did not join: ",
                "check that they were started with this MASTER_ADDR and MASTER_PORT and can reach this host ",
                "(docs/guide/launching.md)");
    TORCH_CHECK(false, "DeviceMesh::from_env: rank ", rank, " of ", world_size, " cannot reach the TCPStore at ", where,
                use_agent_store ? " (torchrun's agent serves it)" : " (rank 0 serves it)", " within the timeout of ",
                options.timeout.count(), " ms: ", cause,
                ". Check that MASTER_ADDR names a host this node can reach (not 127.0.0.1 across machines), that the ",
                "port is open between the nodes, and that ", use_agent_store ? "the agent" : "rank 0",
                " is running (docs/guide/launching.md)");
  }
  if (options.device_type == c10::DeviceType::CUDA && options.device_index < 0) {
    options.device_index = require_int_env("LOCAL_RANK", "this process's GPU index");
  }
  return from_store(store, rank, world_size, std::move(sizes), std::move(names), options);
}

DeviceMesh DeviceMesh::from_store(c10::intrusive_ptr<c10d::Store> store, int64_t rank, int64_t world_size,
                                  std::vector<int64_t> sizes, std::vector<std::string> names, MeshOptions options) {
  TORCH_CHECK(store, "DeviceMesh::from_store: the store is null");
  validate_mesh(sizes, names, world_size, rank);
  // Under torchrun's agent store, every key of this launch lives under its launch round.
  if (store_outlives_launch()) {
    const int64_t round =
        agree_on_launch_round(*store, options.store_prefix + "/launch", rank, world_size, options.timeout);
    options.store_prefix += "/round" + std::to_string(round);
  }
  agree_on_mesh_shape(*store, options.store_prefix, rank, world_size, describe_mesh_shape(sizes, names));
  const bool on_gpu = options.device_type == c10::DeviceType::CUDA;
  const c10::Device device = on_gpu ? cuda_device_of_rank(options.device_index, rank) : c10::Device(c10::kCPU);
  // Note [NCCL communicator set-up]
  // On a CUDA mesh of 2+ dims the world group comes first, bound to this rank's GPU so its NCCL
  // communicator is created at once (one ncclCommInitRank bootstrapped through the store); each dim's
  // group is then made by ncclCommSplit of it (color = the group's first global rank), in dim order
  // on every rank, instead of its own store bootstrap. MESHDDP_NCCL_SPLIT=0 turns splitting off
  // (each group then bootstraps itself, lazily at its warm-up). Set-up cost: docs/reference/gpu.md.
  const bool split = on_gpu && sizes.size() > 1 && switch_on(Switch::kNcclSplit);
  const int device_index = device.has_index() ? device.index() : -1;
  c10::intrusive_ptr<c10d::ProcessGroup> world;
  std::vector<int64_t> all(world_size);
  for (int64_t r = 0; r < world_size; ++r) all[r] = r;
  const std::string world_key = options.store_prefix + "/" + mesh_group_key("world", all);
  auto make_world = [&] {
    world = make_process_group(c10::make_intrusive<c10d::PrefixStore>(world_key, store), static_cast<int>(rank),
                               static_cast<int>(world_size), options.device_type, options.timeout, world_key,
                               NcclSetup{split ? device_index : -1, {}, 0});
    register_collective_progress(world, c10::make_intrusive<c10d::PrefixStore>(world_key + "/progress", store), all,
                                 options.stuck_report_after, options.timeout);
  };
  if (split) make_world();
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups;
  for (int64_t d = 0; d < static_cast<int64_t>(sizes.size()); ++d) {
    const auto ranks = mesh_group_ranks(rank, sizes, d);
    const std::string key = options.store_prefix + "/" + mesh_group_key(names[d], ranks);
    auto group_store = c10::make_intrusive<c10d::PrefixStore>(key, store);
    const auto coords = mesh_coordinates(rank, sizes);
    const NcclSetup nccl = split ? NcclSetup{device_index, world, static_cast<int>(ranks.front())} : NcclSetup{};
    groups.push_back(make_process_group(group_store, static_cast<int>(coords[d]), static_cast<int>(sizes[d]),
                                        options.device_type, options.timeout, key, nccl));
    register_collective_progress(groups.back(), c10::make_intrusive<c10d::PrefixStore>(key + "/progress", store), ranks,
                                 options.stuck_report_after, options.timeout);
  }
  // Note [Group warm-up]: one tiny all-reduce per group, in dim order, on this thread. It checks
  // every group is connected now (an error here names the group, instead of a hang later), and it
  // makes each group's first FlightRecorder entry on one thread: c10d's recorder inserts a group's
  // status into a process-global map before taking its lock, so first collectives of several
  // groups racing from different threads (e.g. TP from the main thread, DP from autograd's) could
  // corrupt it.
  auto warm_up = [&](c10d::ProcessGroup& group, const std::string& what) {
    all_reduce_sum_now(group, at::ones({1}, at::TensorOptions().dtype(at::kFloat).device(device)), what);
  };
  for (size_t d = 0; d < groups.size(); ++d) warm_up(*groups[d], "the warm-up of mesh dim '" + names[d] + "'");
  if (sizes.size() == 1) {
    world = groups[0];
  } else {
    if (!world) make_world();
    warm_up(*world, "the warm-up of the mesh's world group");
  }
  DeviceMesh mesh = from_groups(std::move(sizes), std::move(names), rank, std::move(groups), options.device_type,
                                std::move(world), device.has_index() ? device.index() : -1);
  mesh.derived_->store = store;
  mesh.derived_->options = options;
  mesh.derived_->nccl_split = split;
  mesh.derived_->record_progress = true;
  return mesh;
}

DeviceMesh DeviceMesh::from_groups(std::vector<int64_t> sizes, std::vector<std::string> names, int64_t rank,
                                   std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups_by_dim,
                                   c10::DeviceType device_type, c10::intrusive_ptr<c10d::ProcessGroup> world,
                                   int64_t device_index) {
  int64_t world_size = 1;
  for (int64_t s : sizes) world_size *= s;
  validate_mesh(sizes, names, world_size, rank);
  TORCH_CHECK(groups_by_dim.size() == sizes.size(), "DeviceMesh::from_groups: ", groups_by_dim.size(),
              " process groups for ", sizes.size(), " dims (", describe_mesh_shape(sizes, names),
              "); pass one group per dim, in dim order");
  DeviceMesh mesh;
  mesh.coords_ = mesh_coordinates(rank, sizes);
  for (size_t d = 0; d < sizes.size(); ++d) {
    const auto& group = groups_by_dim[d];
    TORCH_CHECK(group, "DeviceMesh::from_groups: the group for dim '", names[d], "' is null");
    TORCH_CHECK(group->getSize() == sizes[d], "DeviceMesh::from_groups: the group for dim '", names[d], "' has ",
                group->getSize(), " ranks, expected ", sizes[d], " in ", describe_mesh_shape(sizes, names));
    TORCH_CHECK(group->getRank() == mesh.coords_[d], "DeviceMesh::from_groups: rank ", rank, " has coordinate ",
                mesh.coords_[d], " along dim '", names[d], "' (row-major, last dim innermost) but is rank ",
                group->getRank(), " of the group given for that dim; build that group from ranks ",
                mesh_group_key(names[d], mesh_group_ranks(rank, sizes, static_cast<int64_t>(d))), " in that order");
  }
  mesh.sizes_ = std::move(sizes);
  mesh.names_ = std::move(names);
  mesh.rank_ = rank;
  mesh.world_size_ = world_size;
  mesh.device_ =
      device_type == c10::DeviceType::CUDA ? cuda_device_of_rank(device_index, rank) : c10::Device(device_type);
  if (!world && groups_by_dim.size() == 1) world = groups_by_dim[0];
  TORCH_CHECK(!world || world->getSize() == world_size, "DeviceMesh::from_groups: the world group has ",
              world ? world->getSize() : 0, " ranks, expected ", world_size, " (",
              describe_mesh_shape(mesh.sizes_, mesh.names_), ")");
  // Groups a caller made NCCL-only take meshddp's CPU control-plane collectives too.
  for (size_t d = 0; d < groups_by_dim.size(); ++d) {
    ensure_cpu_backend(*groups_by_dim[d], "DeviceMesh::from_groups (dim '" + mesh.names_[d] + "')");
  }
  if (world) ensure_cpu_backend(*world, "DeviceMesh::from_groups (the world group)");
  mesh.groups_ = std::move(groups_by_dim);
  mesh.world_ = std::move(world);
  mesh.derived_ = std::make_shared<DerivedGroups>();
  mesh.derived_->options.device_type = device_type;
  if (mesh.world_) {
    mesh.derived_->store = mesh.world_->getStore();
    try {  // the world group's own timeout where its backend says it (NCCL and Gloo do)
      mesh.derived_->options.timeout = mesh.world_->getDefaultBackend()->getBackendOptions()->timeout;
    } catch (const c10::Error&) {
      // A backend without getBackendOptions(): keep MeshOptions' default.
    }
  }
  return mesh;
}

const c10::intrusive_ptr<c10d::ProcessGroup>& DeviceMesh::operator[](std::string_view dim) const {
  return groups_[mesh_dim_index(names_, dim)];
}

int64_t DeviceMesh::size(std::string_view dim) const { return sizes_[mesh_dim_index(names_, dim)]; }

int64_t DeviceMesh::coordinate(std::string_view dim) const { return coords_[mesh_dim_index(names_, dim)]; }

std::vector<int64_t> DeviceMesh::group_ranks(std::string_view dim) const {
  return mesh_group_ranks(rank_, sizes_, mesh_dim_index(names_, dim));
}

std::vector<int64_t> DeviceMesh::flattened_ranks(const std::vector<std::string>& dims) const {
  return flattened_group_ranks(rank_, sizes_, names_, dims);
}

c10::intrusive_ptr<c10d::ProcessGroup> DeviceMesh::flattened(const std::vector<std::string>& dims) const {
  const auto indices = mesh_dim_subset(names_, dims);
  // Dims of size 1 change neither the members nor their order: a group over one dim of size > 1 is
  // that dim's group, one over every dim of size > 1 the world group.
  std::vector<int64_t> wide;
  for (int64_t d : indices) {
    if (sizes_[d] > 1) wide.push_back(d);
  }
  if (wide.size() <= 1) return groups_[wide.empty() ? indices.front() : wide.front()];
  const auto mesh_wide = std::count_if(sizes_.begin(), sizes_.end(), [](int64_t s) { return s > 1; });
  if (static_cast<int64_t>(wide.size()) == mesh_wide && world_) return world_;
  return group_of(flattened_dims_name(dims), flattened_groups(sizes_, names_, dims));
}

c10::intrusive_ptr<c10d::ProcessGroup> DeviceMesh::group_of(const std::string& name, const RankGroups& groups) const {
  TORCH_CHECK(!name.empty(), "DeviceMesh::group_of: the group name is empty; name the groups (e.g. \"ep\")");
  TORCH_INTERNAL_ASSERT(derived_, "DeviceMesh::group_of on a mesh that was not built by from_store/from_groups");
  std::lock_guard<std::mutex> lock(derived_->mutex);
  const auto known = derived_->by_name.find(name);
  if (known != derived_->by_name.end()) {
    TORCH_CHECK(known->second.first == groups, "DeviceMesh::group_of: the name '", name, "' already names the groups ",
                describe_rank_groups(known->second.first), ", not ", describe_rank_groups(groups),
                "; give these groups another name");
    return known->second.second;
  }
  TORCH_CHECK(derived_->store, "DeviceMesh::group_of: this mesh (", describe(), ") was built by from_groups() ",
              "without a world group that has a store, so it cannot make the groups '", name, "'; pass a world group ",
              "to from_groups(), or build the mesh with from_store() or from_env()");
  agree_through_store(*derived_->store, derived_->options.store_prefix + "/derived_agreement/" + name, rank_,
                      world_size_, describe_rank_groups(groups), "the groups named '" + name + "'",
                      "Make every rank ask for the same groups, in the same order");
  validate_rank_groups(groups, world_size_, name);  // after the agreement: the same verdict on every rank
  auto group = make_derived_group(name, group_containing(groups, rank_, name));
  derived_->by_name.emplace(name, std::make_pair(groups, group));
  return group;
}

c10::intrusive_ptr<c10d::ProcessGroup> DeviceMesh::make_derived_group(const std::string& name,
                                                                      const std::vector<int64_t>& ranks) const {
  const DerivedGroups& derived = *derived_;
  const auto& store = derived.store;
  const std::string key = derived.options.store_prefix + "/derived/" + mesh_group_key(name, ranks);
  const auto group_rank = std::find(ranks.begin(), ranks.end(), rank_) - ranks.begin();
  TORCH_INTERNAL_ASSERT(group_rank < static_cast<int64_t>(ranks.size()), "rank ", rank_, " not in ", key);
  const NcclSetup nccl = derived.nccl_split ? NcclSetup{device_.has_index() ? device_.index() : -1, world_,
                                                        static_cast<int>(ranks.front())}
                                            : NcclSetup{};
  auto group = make_process_group(c10::make_intrusive<c10d::PrefixStore>(key, store), static_cast<int>(group_rank),
                                  static_cast<int>(ranks.size()), derived.options.device_type, derived.options.timeout,
                                  key, nccl);
  if (derived.record_progress) {
    register_collective_progress(group, c10::make_intrusive<c10d::PrefixStore>(key + "/progress", store), ranks,
                                 derived.options.stuck_report_after, derived.options.timeout);
  }
  all_reduce_sum_now(*group, at::ones({1}, at::TensorOptions().dtype(at::kFloat).device(device_)),
                     "the warm-up of the mesh's group '" + name + "' (ranks " + describe_ranks(ranks) + ")");
  return group;
}

std::string DeviceMesh::describe() const {
  std::ostringstream out;
  out << describe_mesh_shape(sizes_, names_) << ", rank " << rank_ << " at (";
  for (size_t d = 0; d < names_.size(); ++d) out << (d ? ", " : "") << names_[d] << "=" << coords_[d];
  out << ")";
  return out.str();
}

}  // namespace meshddp
