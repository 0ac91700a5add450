#include "checkpoint/whole_checkpoint.h"

#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"
#include "mesh/process_group_factory.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <chrono>
#include <set>

namespace meshddp {

WholeCheckpoint read_whole_checkpoint(const std::string& dir, std::optional<int64_t> step, bool with_optimizer) {
  // The reader's agreements are collectives; over one rank they are local.
  CheckpointMesh mesh;
  mesh.world = make_process_group(c10::make_intrusive<c10d::HashStore>(), 0, 1, c10::DeviceType::CPU,
                                  std::chrono::minutes(1), "meshddp-whole-checkpoint");
  CheckpointReader reader(mesh, dir, step);
  std::vector<CheckpointTensor> wanted;
  std::set<std::string> model_keys;
  for (const auto& [key, entry] : reader.manifest().tensors) {
    const bool model = key.rfind("model/", 0) == 0;
    if (model) model_keys.insert(key);
    if (!model && !with_optimizer) continue;
    CheckpointTensor w;
    w.key = key;
    w.global_shape = entry.shape;
    w.data = at::empty({0}, at::TensorOptions().dtype(scalar_type_from_safetensors(entry.dtype)));
    w.end = c10::multiply_integers(entry.shape);  // slice {-1}: the whole tensor, TP-unsharded
    wanted.push_back(std::move(w));
  }
  const std::vector<at::Tensor> loaded = reader.read(wanted, model_keys);
  WholeCheckpoint whole{reader.path(), reader.meta(), {}};
  for (size_t i = 0; i < wanted.size(); ++i)
    whole.tensors.emplace_back(wanted[i].key, loaded[i].view(wanted[i].global_shape));
  return whole;
}

}  // namespace meshddp
