"""Which ranks share a parameter's reduction, as rank lists (mesh/reduction_groups.h): pure rank
arithmetic over a mesh's dim sizes and names (row-major ranks), no communication. Make a group of
each list with torch.distributed.new_group on every rank, in the order given. meshddp builds these
groups itself from a torch DeviceMesh; the functions are for a trainer that needs the same groups
(e.g. for its own logging or a custom collective)."""

from meshddp import _C
from meshddp._C import (  # noqa: F401  (re-exported: the public home of these functions)
    cross_instance_groups,
    expert_data_parallel_groups,
    expert_parallel_groups,
    flattened_group_ranks,
    flattened_groups,
    optimizer_instance_groups,
)


def embedding_groups(sizes, names, pp_dim="pp"):
    """Per pipeline of a mesh of `sizes` and dim `names` (row-major ranks): [first stage, last stage]
    (the embedding group: make each with torch.distributed.new_group on every rank); middle stages
    alone."""
    return _C.embedding_groups(list(sizes), list(names), pp_dim)


__all__ = [
    "cross_instance_groups",
    "embedding_groups",
    "expert_data_parallel_groups",
    "expert_parallel_groups",
    "flattened_group_ranks",
    "flattened_groups",
    "optimizer_instance_groups",
]
