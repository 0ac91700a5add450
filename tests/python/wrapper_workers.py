"""Workers of test_wrappers.py (run on N ranks by multiprocess.run("wrapper_workers.<name>", ...))."""

import threading

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import meshddp


def _wide_net():
    # ~1.3M params in buckets of 1 MiB: the param all-gathers after a step take long enough on Gloo
    # that a forward right after step() begins while some are still in flight.
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1024),
                               torch.nn.Tanh(), torch.nn.Linear(1024, 8))


def raw_forward_after_overlapped_step(rank, world_size, on_thread):
    """ZeRO-1 with overlap_param_gather: after each step(), a forward through the raw module (on this
    thread, or on another one) against the same forward after finish_param_sync(). Returns per step the
    gathers pending right after step() and max |raw - synced|."""
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    model = _wide_net()
    ddp = meshddp.DistributedDataParallel(model, mesh, config=meshddp.DdpConfig(bucket_bytes=1 << 20,
                                                                                use_distributed_optimizer=True))
    opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(lr=0.05, overlap_param_gather=True))
    gen = torch.Generator().manual_seed(1)
    probe = torch.randn(4, 256, generator=gen)
    out = []
    for step in range(3):
        ddp.zero_grad_buffer()
        x, y = torch.randn(8, 256, generator=gen), torch.randn(8, 8, generator=gen)
        F.mse_loss(ddp(x + rank), y).backward()
        opt.step()
        pending = ddp._engine.pending_param_gathers()
        raw = {}
        with torch.no_grad():
            if on_thread:
                t = threading.Thread(target=lambda: raw.update(out=model(probe)))
                t.start()
                t.join()
            else:
                raw["out"] = model(probe)
        opt.finish_param_sync()
        with torch.no_grad():
            synced = model(probe)
        out.append((pending, (raw["out"] - synced).abs().max().item()))
    return out
