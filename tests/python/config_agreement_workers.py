"""Rank functions for test_config_agreement.py."""
import torch
from torch.distributed.device_mesh import init_device_mesh

import meshddp


def model():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def invalid_on_one_rank(rank, world_size, which):
    """Rank 1 alone gives a value its config's validate() rejects: DdpConfig(comm_hook="bogus"), or
    OptimizerConfig(lr=-1.0). Returns each rank's error (None: no error)."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    bad = rank == 1
    try:
        ddp_config = meshddp.DdpConfig(use_distributed_optimizer=True, comm_hook="bogus" if bad and which == "ddp"
                                       else "none")
        optimizer_config = meshddp.DistributedOptimizerConfig(lr=-1.0 if bad and which == "optimizer" else 1e-3)
        ddp = meshddp.DistributedDataParallel(model(), mesh, config=ddp_config)
        meshddp.DistributedOptimizer(ddp, optimizer_config)
    except RuntimeError as e:
        return str(e)
    return None
