"""Fixtures shared by the pytest suites of tests/python."""

import os

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


@pytest.fixture(scope="module")
def mesh():
    """A 1 x 1 ("dp", "tp") mesh of this process alone (Gloo, CPU); a suite may define its own."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    import multiprocess

    os.environ["MASTER_PORT"] = str(multiprocess._free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    dist.destroy_process_group()
