"""Workers for test_muon_resume.py: Muon (fp32 iteration) on muon_workers.MuonNet over a DP x TP
mesh (fc1 column-parallel and fc2 row-parallel with torch's DTensor TP when TP > 1), saved and
resumed through meshddp's checkpoint format at other DP x TP sizes."""

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import meshddp
from muon_workers import ADAMW_GROUPS, LR, WD, MuonNet, global_batch

ROWS = 16  # the global batch: the same rows at every DP size


def build(world_size, tp, kind="muon", shard_policy="whole_param", muon_adamw_params="*embed*,*lm_head*"):
    torch.manual_seed(0)
    model = MuonNet()
    dp = world_size // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    ddp = meshddp.DistributedDataParallel(model, mesh, config=meshddp.DdpConfig(
        bucket_bytes=8192, use_distributed_optimizer=True, shard_policy=shard_policy))
    opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(
        kind=kind, lr=LR, weight_decay=WD, groups=ADAMW_GROUPS, muon_ns_dtype="fp32",
        muon_adamw_params=muon_adamw_params))
    return ddp, opt, mesh.get_local_rank("dp"), dp


def train(ddp, opt, me, dp, first, last):
    for step in range(first, last):
        x, y = global_batch(step, ROWS // 4)
        ddp.zero_grad_buffer()
        F.mse_loss(ddp(x.chunk(dp)[me]), y.chunk(dp)[me]).backward()
        opt.step()
    opt.finish_param_sync()


def full_params(ddp):
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in ddp.module.named_parameters()}


def muon_tp_resumable(rank, world_size, tp, first, last, save_dir=None, load_dir=None, resave_dir=None):
    """Steps [first, last) at dp x tp (dp = world_size / tp): from a fresh model, or from load_dir's
    checkpoint; resave_dir gets a save right after the load (the loaded state, as this mesh holds
    it), save_dir one at the end. Returns the whole (TP-gathered) params."""
    ddp, opt, me, dp = build(world_size, tp)
    if load_dir is not None:
        opt.load_checkpoint(load_dir)
        assert opt.steps_taken == first, opt.steps_taken
        if resave_dir is not None:
            opt.save_checkpoint(resave_dir)
    train(ddp, opt, me, dp, first, last)
    if save_dir is not None:
        opt.save_checkpoint(save_dir)
    return full_params(ddp)


def load_into(rank, world_size, tp, load_dir, resave_dir=None, **settings):
    """Loads load_dir's checkpoint into a fresh optimizer built with `settings` (build()'s): the error
    text, or None (then saved again into resave_dir)."""
    ddp, opt, me, dp = build(world_size, tp, **settings)
    try:
        opt.load_checkpoint(load_dir)
    except RuntimeError as e:
        return str(e)
    if resave_dir is not None:
        opt.save_checkpoint(resave_dir)
    return None


def save_after(rank, world_size, tp, steps, save_dir, dcp_dir=None, **settings):
    """`steps` steps, then a save in meshddp's format (and, with dcp_dir, through DCP)."""
    ddp, opt, me, dp = build(world_size, tp, **settings)
    train(ddp, opt, me, dp, 0, steps)
    opt.save_checkpoint(save_dir)
    out = full_params(ddp)
    if dcp_dir is not None:
        sd = opt.state_dict()
        out["state kinds"] = {name: sorted(kinds) for name, kinds in sd["state"].items()}
        dcp.save({"model": ddp.state_dict(), "optim": sd}, checkpoint_id=dcp_dir)
    return out


def resume_from_dcp(rank, world_size, tp, first, last, dcp_dir, resave_dir):
    """Steps [first, last) from a DCP checkpoint of the model's and optimizer's state dicts; the loaded
    state saved again in meshddp's format into resave_dir first."""
    ddp, opt, me, dp = build(world_size, tp)
    sd = {"model": ddp.state_dict(), "optim": opt.state_dict()}
    dcp.load(sd, checkpoint_id=dcp_dir)
    ddp.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    assert opt.steps_taken == first, opt.steps_taken
    opt.save_checkpoint(resave_dir)
    train(ddp, opt, me, dp, first, last)
    return full_params(ddp)
