"""The process groups a Python DistributedDataParallel needs beyond DP and TP, made from a torch
DeviceMesh with the C++ engine's own arithmetic (mesh/reduction_groups.h, bound as
meshddp.groups.expert_data_parallel_groups, ...): the expert-data-parallel group of expert (MoE) params and
the hierarchical ZeRO-1 groups (num_distributed_optimizer_instances), and the embedding group of a
pipeline mesh (weights tied across stages). The C++ DeviceMesh constructor
of DistributedDataParallel makes the same groups (plugin/distributed_data_parallel.cpp).

Expert params are declared by module-path pattern (expert_params=["*.experts.*"]: HF-style experts,
separate modules named by their global index) or are DTensors on the expert-parallel sub-mesh
(torchtitan-style: all experts of a layer in one param, Shard(0) over EP). Their local tensors are
marked with the C++ declare_expert_param before the engine is built, which then reduces them over the
expert-data-parallel group."""

import torch.distributed as dist
from torch.distributed.tensor.placement_types import Shard

from meshddp import _C

# Subgroups made once per rank list: a second DDP over the same mesh reuses them (as DeviceMesh::group_of).
_subgroups = {}


def _error(what):
    return RuntimeError(f"meshddp.DistributedDataParallel: {what}")


def mesh_ranks(mesh):
    return mesh.mesh.flatten().tolist()


def subgroup(global_ranks):
    """A process group of `global_ranks` (this rank among them), made by its members only."""
    key = tuple(global_ranks)
    if key not in _subgroups:
        _subgroups[key] = dist.new_group(list(key), use_local_synchronization=True)
    return _subgroups[key]


def _mine(groups, mesh):
    """This rank's group of `groups` (lists of mesh indices), as global ranks."""
    ranks = mesh_ranks(mesh)
    me = ranks.index(dist.get_rank())
    for g in groups:
        if me in g:
            return [ranks[i] for i in g]
    raise AssertionError(f"meshddp: mesh rank {me} is in none of the groups {groups}")


def expert_parallel_ranks(mesh, dp_dims, ep):
    """The global ranks of this rank's EP group (its experts' peers)."""
    return _mine(_C.expert_parallel_groups(list(mesh.shape), list(mesh.mesh_dim_names), list(dp_dims), ep), mesh)


def is_expert_dtensor(param, mesh, dp_dims, ep):
    """Whether DTensor `param` lives on this rank's expert-parallel sub-mesh (1-D, the ranks of
    meshddp.groups.expert_parallel_groups(..., ep)) sharded over it: a torchtitan-style expert param."""
    pmesh = param.device_mesh
    if ep <= 1 or mesh is None or pmesh.ndim != 1 or pmesh.size() != ep:
        return False
    if mesh_ranks(pmesh) != expert_parallel_ranks(mesh, dp_dims, ep):
        return False
    if not isinstance(param.placements[0], Shard):
        raise _error(f"expert parameter DTensor on the expert-parallel mesh has placements {param.placements}; "
                     f"meshddp supports experts sharded over EP (Shard(0): each EP rank holds its experts)")
    return True


def expert_name(name, param, mesh, dp_dims, ep):
    """The engine's name for the local shard of an EP DTensor: '<name>@ep<e>of<E>' (each EP rank holds
    other experts under the one module path; the engine keys checkpoints and checks by name)."""
    e = expert_parallel_ranks(mesh, dp_dims, ep).index(dist.get_rank())
    return f"{name}@ep{e}of{ep}"


def matches(name, patterns):
    return any(_C._glob_match(p, name) for p in patterns)


def expert_dp_group(mesh, dp_dims, ep):
    """The expert-data-parallel group (ranks that hold the same experts), or None at EP 1 (the engine
    then reduces expert params over the DP group itself)."""
    if ep == 1:
        return None
    if mesh is None:
        raise _error(f"DdpConfig.expert_parallel_size = {ep} needs the DeviceMesh (mesh=) to make the "
                     f"expert-data-parallel groups, not a process group")
    groups = _C.expert_data_parallel_groups(list(mesh.shape), list(mesh.mesh_dim_names), list(dp_dims), ep)
    return subgroup(_mine(groups, mesh))


def expert_instance_group(mesh, dp_dims, config):
    """Hierarchical ZeRO-1 with experts (K > 1, EP > 1): this rank's expert-DP ranks within its
    optimizer instance (Megatron-core's intra-instance expert-DP group), over which the engine
    reduce-scatters expert buckets before all-reducing their shards across the instances; None
    otherwise (at EP 1 the engine shards expert buckets over the instance group itself). As the C++
    DeviceMesh constructor (plugin/distributed_data_parallel.cpp: use_expert_optimizer_instances)."""
    k, ep = config.num_distributed_optimizer_instances, config.expert_parallel_size
    if mesh is None or k == 1 or ep == 1 or not config.use_distributed_optimizer:
        return None
    groups = _C.expert_data_parallel_groups(list(mesh.shape), list(mesh.mesh_dim_names), list(dp_dims), ep)
    size = len(groups[0])
    if size % k:
        raise _error(f"num_distributed_optimizer_instances = {k} does not divide the expert-data-parallel size "
                     f"{size} (data-parallel size / expert_parallel_size = {ep}; rank {dist.get_rank()}); expert "
                     f"buckets are sharded within each instance, so choose a K that divides {size}, or a smaller "
                     f"expert_parallel_size")
    return subgroup(_mine(_C.optimizer_instance_groups(groups, k, "expert_dp"), mesh))


def optimizer_instance_groups(mesh, dp_dims, config, agreement_group):
    """(instance group, cross-instance group) for num_distributed_optimizer_instances = K > 1, or
    (None, None). K is agreed over `agreement_group` first: a rank with another K would make other
    groups (or none) and leave its peers waiting."""
    k = config.num_distributed_optimizer_instances
    if mesh is None:
        if k > 1:
            raise _error(f"num_distributed_optimizer_instances = {k} needs the DeviceMesh (mesh=) to make the "
                         f"instance groups; this DDP was given a process group. Pass the mesh, or set the instances to 1")
        return None, None
    _C._verify_same_settings(agreement_group, [("num_distributed_optimizer_instances", str(k))],
                             "meshddp.DistributedDataParallel", "the hierarchical ZeRO-1 settings")
    if k == 1:
        return None, None
    if not config.use_distributed_optimizer:
        return None, None  # the engine refuses it with the C++ text
    names = list(mesh.mesh_dim_names)
    dp_groups = _C.flattened_groups(list(mesh.shape), names, list(dp_dims))
    what = "+".join(dp_dims)
    instance = _mine(_C.optimizer_instance_groups(dp_groups, k, what), mesh)
    cross = _mine(_C.cross_instance_groups(dp_groups, k, what), mesh)
    return subgroup(instance), subgroup(cross)


def embedding_group(mesh):
    """On a mesh with a "pp" dim: this rank's embedding group, its pipeline's first and last stage
    (meshddp.groups.embedding_groups; a middle stage alone), over which a weight tied across stages is summed;
    made by its members at the first DDP over the mesh (the C++ mesh makes it the same way). None
    without a "pp" dim or a mesh."""
    if mesh is None or "pp" not in (mesh.mesh_dim_names or ()):
        return None
    return subgroup(_mine(_C.embedding_groups(list(mesh.shape), list(mesh.mesh_dim_names), "pp"), mesh))


def pipeline_group(mesh):
    """On a mesh with a "pp" dim of more than one rank: this rank's pipeline (one rank per stage), over
    which gradient norms and non-finite checks are summed after the stage's. None otherwise."""
    if mesh is None or "pp" not in (mesh.mesh_dim_names or ()) or mesh.size(mesh.mesh_dim_names.index("pp")) == 1:
        return None
    return mesh.get_group("pp")
