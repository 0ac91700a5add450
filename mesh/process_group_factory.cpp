#include "mesh/process_group_factory.h"

#include "mesh/launch_round.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <cstdlib>
#include <string_view>
#ifdef MESHDDP_WITH_CUDA
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace meshddp {
namespace {

c10::intrusive_ptr<c10d::Backend> make_gloo(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                            std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  // GLOO_SOCKET_IFNAME picks the interface; otherwise loopback while the master is local.
  // Multi-node runs (MASTER_ADDR not on this host) use the hostname's interface.
  const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
  const char* master = std::getenv("MASTER_ADDR");
  const bool local_master =
      master == nullptr || std::string_view(master) == "127.0.0.1" || std::string_view(master) == "localhost";
  if (ifname != nullptr && *ifname != '\0') {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
  } else if (local_master) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  } else {
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

}  // namespace

c10::intrusive_ptr<c10d::ProcessGroup> make_process_group(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                          int size, c10::DeviceType device_type,
                                                          std::chrono::milliseconds timeout, const std::string& name,
                                                          const NcclSetup& nccl_setup) {
  TORCH_CHECK(device_type == c10::DeviceType::CPU || device_type == c10::DeviceType::CUDA, "DeviceMesh: group '", name,
              "' asks for device type ", device_type, "; only CPU (Gloo) and CUDA (NCCL) meshes are supported");
  // Like PyTorch's default "cpu:gloo,cuda:nccl": every group takes CPU tensors through Gloo (the
  // checkpoint agreement, the non-finite report and other small host-side collectives), and CUDA
  // tensors through NCCL on a CUDA mesh. On a CPU (Gloo) mesh, Gloo takes CUDA tensors too (several
  // ranks sharing one GPU, where NCCL refuses duplicate devices).
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  auto gloo = make_gloo(c10::make_intrusive<c10d::PrefixStore>("gloo", store), rank, size, timeout);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
  if (device_type == c10::DeviceType::CPU) {
    group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::GLOO, gloo);
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  } else {
#ifdef MESHDDP_WITH_CUDA
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    options->group_name = name;  // the watchdog's timeout message names the group by it
#ifdef NCCL_HAS_COMM_SPLIT
    if (nccl_setup.split_parent) {
      auto parent = c10::dynamic_intrusive_pointer_cast<c10d::ProcessGroupNCCL>(
          nccl_setup.split_parent->getBackend(c10::DeviceType::CUDA));
      TORCH_INTERNAL_ASSERT(parent, "DeviceMesh: group '", name, "': the split parent has no NCCL backend");
      options->split_from = parent;
      options->split_color = nccl_setup.split_color;
    }
#endif
    auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(c10::make_intrusive<c10d::PrefixStore>("nccl", store), rank,
                                                            size, options);
    if (nccl_setup.device_index >= 0) {
      const c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(nccl_setup.device_index));
      nccl->setBoundDeviceId(device);
      nccl->eagerConnectSingleDevice(device);  // the communicator now (or the split, collective over the parent)
      // setBackend hands the backend the group's bound device, which would clear the one set above.
      group->setBoundDeviceId(device);
    }
    group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
#else
    TORCH_CHECK(false, "DeviceMesh: group '", name, "' asks for NCCL (a CUDA mesh) but meshddp was built ",
                "without CUDA (no nvcc at configure time); build with nvcc or use a CPU mesh");
#endif
  }
  group->setGroupName(name);
  return group;
}

void ensure_cpu_backend(c10d::ProcessGroup& group, const std::string& what) {
  const std::vector<c10::Device> device_types = group.getDeviceTypes();
  c10::intrusive_ptr<c10d::Backend> existing_gloo;
  for (const c10::Device& device : device_types) {
    if (device.type() == c10::DeviceType::CPU) return;
    auto backend = group.getBackend(device.type());
    if (backend->getBackendName() == "gloo") existing_gloo = backend;
  }
  if (!existing_gloo) {
    const auto store = group.getStore();
    TORCH_CHECK(store, what, ": process group '", group.getGroupName(), "' (", group.getBackendName(),
                ") has no backend for CPU tensors, which meshddp's agreement checks use, and no store to make one ",
                "from; create it with a CPU backend too, e.g. init_process_group(\"cpu:gloo,cuda:nccl\") or ",
                "new_group(..., backend=\"cpu:gloo,cuda:nccl\")");
    // The group's own timeout where its backend says it (NCCL does), else c10d's default.
    std::chrono::milliseconds timeout = kProcessGroupDefaultTimeout;
    try {
      timeout = group.getDefaultBackend()->getBackendOptions()->timeout;
    } catch (const c10::Error&) {
      // A backend without getBackendOptions(): keep the default.
    }
    // The prefix is the same on every member (torch names a group identically on all of its ranks)
    // and differs from the keys of the group's own backends.
    std::string side_prefix = "meshddp_cpu_side/" + group.getGroupName();
    if (store_outlives_launch()) {  // Note [Launch rounds]: not the side group of a dead launch
      side_prefix += "/round" + std::to_string(agree_on_launch_round(*store, side_prefix + "/launch", group.getRank(),
                                                                     group.getSize(), timeout));
    }
    auto side_store = c10::make_intrusive<c10d::PrefixStore>(side_prefix, store);
    existing_gloo = make_gloo(side_store, group.getRank(), group.getSize(), timeout);
  }
  // A Gloo backend that served only CUDA tensors ("cuda:gloo") takes CPU tensors as well.
  group.setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, existing_gloo);
}

}  // namespace meshddp
