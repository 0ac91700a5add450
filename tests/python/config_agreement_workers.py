"""Rank functions for test_config_agreement.py."""
import os
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh

import meshddp


def model():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def error_of_peer_that_left(rank, world_size):
    """Rank 1's config is refused where it is made (Python validates configs at construction), and
    rank 1 stops; rank 0, in DDP's settings check, gets the error that says so."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    if rank == 1:
        try:
            meshddp.DdpConfig(comm_hook="bogus")
        except RuntimeError:
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(0)
    try:
        meshddp.DistributedDataParallel(model(), mesh)
    except RuntimeError as e:
        return str(e)
    return None
