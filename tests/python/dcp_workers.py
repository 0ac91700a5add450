"""Rank functions for test_dcp.py: meshddp's ZeRO-1 optimizer saved with torch.distributed.checkpoint
at one DP size and resumed at another. Each step's global batch is the same whatever the DP size
(8 samples, cut into equal per-rank slices), so runs at different sizes train the same model."""

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import meshddp
from workers import Net

SAVE_AT = 4    # steps before the save
CONTINUE = 4   # steps after the load
LR_CHANGE = 2  # set_lr(LR / 2) from this step: the state dict restores it
LR = 0.01
# AdamW on fp32 params (an fp32 param is its own master); SGD with momentum on bf16 params (fp32
# masters in the optimizer state); a bias rule gives a second param group.
VARIANTS = {"adamw_fp32": ("adamw", torch.float32), "sgd_bf16": ("sgd", torch.bfloat16)}


def global_batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)


def build(world_size, seed, variant, device="cpu"):
    kind, dtype = VARIANTS[variant]
    torch.manual_seed(seed)
    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("dp",))
    ddp = meshddp.DistributedDataParallel(Net().to(device, dtype), mesh, config=meshddp.DdpConfig(
        bucket_bytes=1024, use_distributed_optimizer=True))
    opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(
        kind=kind, lr=LR, momentum=0.9, weight_decay=0.01, groups=[("*.bias", None, 0.0)]))
    return ddp, opt


def train(ddp, opt, rank, world_size, steps):
    """The global mean loss of each step (on the params' device)."""
    dtype, device = next(ddp.parameters()).dtype, next(ddp.parameters()).device
    n = 8 // world_size
    losses = []
    for step in steps:
        if step == LR_CHANGE:
            opt.set_lr(LR / 2)
        ddp.zero_grad_buffer()
        x, y = global_batch(step)
        rows = slice(rank * n, (rank + 1) * n)
        loss = F.mse_loss(ddp(x[rows].to(device, dtype)).float(), y[rows].to(device))
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    opt.finish_param_sync()
    return losses


def params_of(ddp):
    return [p.detach().to("cpu", torch.float32, copy=True) for p in ddp.parameters()]


def save(rank, world_size, directory, device="cpu"):
    """SAVE_AT steps, then a DCP checkpoint (and meshddp's own format, for the bit-exact comparison).
    device "cuda": the model, the optimizer state and the collectives on this rank's GPU."""
    out = {}
    for variant in VARIANTS:
        ddp, opt = build(world_size, 0, variant, device)
        out[variant] = train(ddp, opt, rank, world_size, range(SAVE_AT))
        dcp.save({"model": ddp.state_dict(), "optim": opt.state_dict()},
                 checkpoint_id=os.path.join(directory, variant, "dcp"))
        opt.save_checkpoint(os.path.join(directory, variant, "meshddp"))
    return out


def resume(rank, world_size, directory, device="cpu"):
    """Per variant: the uninterrupted run at this size; the run resumed from the DCP checkpoint (into a
    model and optimizer built with other initial values); the run resumed from meshddp's format."""
    out = {}
    for variant in VARIANTS:
        ddp, opt = build(world_size, 0, variant, device)
        full_losses = train(ddp, opt, rank, world_size, range(SAVE_AT + CONTINUE))
        full = params_of(ddp)

        ddp, opt = build(world_size, 1, variant, device)
        sd = {"model": ddp.state_dict(), "optim": opt.state_dict()}
        dcp.load(sd, checkpoint_id=os.path.join(directory, variant, "dcp"))
        ddp.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        loaded = {"steps_taken": opt.steps_taken, "lr": opt._impl.lr(), "bias_wd": opt._impl.group_weight_decay(1)}
        dcp_losses = train(ddp, opt, rank, world_size, range(SAVE_AT, SAVE_AT + CONTINUE))
        resumed = params_of(ddp)

        ddp, opt = build(world_size, 2, variant, device)
        opt.load_checkpoint(os.path.join(directory, variant, "meshddp"))
        opt.set_lr(LR / 2)  # meshddp's format leaves the LR to the trainer's schedule
        own_losses = train(ddp, opt, rank, world_size, range(SAVE_AT, SAVE_AT + CONTINUE))
        out[variant] = {
            "full_losses": full_losses, "dcp_losses": dcp_losses, "own_losses": own_losses, "loaded": loaded,
            "vs_full": max((a - b).abs().max().item() for a, b in zip(full, resumed)),
            "vs_own": max((a - b).abs().max().item() for a, b in zip(params_of(ddp), resumed)),
        }
    return out


def build_tp(dp, seed):
    """workers.Block with fc1/fc2 parallelized over "tp" (2 ranks) of a dp x 2 mesh, under ZeRO-1."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from workers import Block

    torch.manual_seed(seed)
    model = Block()
    mesh = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    ddp = meshddp.DistributedDataParallel(model, mesh, "dp", meshddp.DdpConfig(bucket_bytes=512,
                                                                               use_distributed_optimizer=True))
    opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="adamw", lr=LR, weight_decay=0.01))
    return ddp, opt, mesh.get_local_rank("dp")


def train_tp(ddp, opt, dp_rank, dp, steps):
    n = 8 // dp
    for step in steps:
        ddp.zero_grad_buffer()
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
        F.mse_loss(ddp(x[dp_rank * n:(dp_rank + 1) * n]), y[dp_rank * n:(dp_rank + 1) * n]).backward()
        opt.step()
    opt.finish_param_sync()
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in ddp.parameters()]


def tp_save(rank, world_size, directory):
    ddp, opt, dp_rank = build_tp(world_size // 2, 0)
    train_tp(ddp, opt, dp_rank, world_size // 2, range(SAVE_AT))
    dcp.save({"model": ddp.state_dict(), "optim": opt.state_dict()}, checkpoint_id=os.path.join(directory, "tp_dcp"))
    opt.save_checkpoint(os.path.join(directory, "tp_meshddp"))
    return sorted(opt.state_dict()["state"])


def tp_resume(rank, world_size, directory):
    """At dp = world_size / 2, TP 2: resumed from DCP vs from meshddp's format, the params after CONTINUE steps."""
    dp = world_size // 2
    ddp, opt, dp_rank = build_tp(dp, 1)
    sd = {"model": ddp.state_dict(), "optim": opt.state_dict()}
    dcp.load(sd, checkpoint_id=os.path.join(directory, "tp_dcp"))
    ddp.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    resumed = train_tp(ddp, opt, dp_rank, dp, range(SAVE_AT, SAVE_AT + CONTINUE))
    ddp, opt, dp_rank = build_tp(dp, 2)
    opt.load_checkpoint(os.path.join(directory, "tp_meshddp"))
    own = train_tp(ddp, opt, dp_rank, dp, range(SAVE_AT, SAVE_AT + CONTINUE))
    return max((a - b).abs().max().item() for a, b in zip(own, resumed))


def one_rank_refuses(rank, world_size):
    """Rank 1's state dict lacks a param; every rank's load_state_dict must fail, none hang or load."""
    ddp, opt = build(world_size, 0, "adamw_fp32")
    sd = opt.state_dict()
    if rank == 1:
        del sd["state"]["out.weight"]
    try:
        opt.load_state_dict(sd)
        return None
    except RuntimeError as e:
        return str(e)


def ranks_disagree(rank, world_size, field):
    """Rank 1's state dict has another `field` than rank 0's (e.g. each rank read another checkpoint):
    every rank's load_state_dict must fail, and none load."""
    ddp, opt = build(world_size, 0, "adamw_fp32")
    train(ddp, opt, rank, world_size, range(3))
    sd = opt.state_dict()
    if rank == 1:
        if field == "step":
            sd["step"] = torch.tensor(7)
        elif field == "lr":
            sd["lr"] = LR * 3
        else:
            sd["param_groups"][1]["weight_decay"] = 0.5
    try:
        opt.load_state_dict(sd)
        return None
    except RuntimeError as e:
        return {"error": str(e), "steps_taken": opt.steps_taken, "lr": opt._impl.lr(),
                "bias_wd": opt._impl.group_weight_decay(1)}


def async_save(rank, world_size, directory):
    """Per variant: SAVE_AT steps, then dcp.save and dcp.async_save of the same state (the async one on
    a Gloo group of its own, since its collectives run on DCP's writer thread, and staged by
    meshddp.DcpStager), CONTINUE more steps while the
    async write is in flight, its future's result; then each checkpoint resumed into a model and
    optimizer built with other initial values, trained the same CONTINUE steps."""
    side = dist.new_group(backend="gloo")
    stager = meshddp.DcpStager()  # torch's default stager cannot copy a ShardedTensor
    out = {}
    for variant in VARIANTS:
        ddp, opt = build(world_size, 0, variant)
        train(ddp, opt, rank, world_size, range(SAVE_AT))
        path = os.path.join(directory, variant)
        dcp.save({"model": ddp.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path + "-sync")
        future = dcp.async_save({"model": ddp.state_dict(), "optim": opt.state_dict()},
                                checkpoint_id=path + "-async", process_group=side, async_stager=stager)
        full_losses = train(ddp, opt, rank, world_size, range(SAVE_AT, SAVE_AT + CONTINUE))
        future.result()
        full = params_of(ddp)
        result = {"full_losses": full_losses}
        for kind in ("sync", "async"):
            ddp, opt = build(world_size, 1, variant)
            sd = {"model": ddp.state_dict(), "optim": opt.state_dict()}
            dcp.load(sd, checkpoint_id=f"{path}-{kind}")
            ddp.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])
            result[f"{kind}_losses"] = train(ddp, opt, rank, world_size, range(SAVE_AT, SAVE_AT + CONTINUE))
            result[f"{kind}_vs_full"] = max((a - b).abs().max().item() for a, b in zip(full, params_of(ddp)))
        out[variant] = result
    dist.destroy_process_group(side)
    return out


def meshddp_async_save(rank, world_size, directory):
    """meshddp's format: opt.save_checkpoint(async_save=True) at SAVE_AT, training on while it writes, a
    checkpoint_step_boundary() per step and wait_checkpoint() at the end; then resumed (and the sync
    save of the same step resumed) into optimizers built with other initial values."""
    ddp, opt = build(world_size, 0, "adamw_fp32")
    train(ddp, opt, rank, world_size, range(SAVE_AT))
    opt.save_checkpoint(os.path.join(directory, "sync"))
    started = opt.save_checkpoint(os.path.join(directory, "async"), async_save=True)
    reports = []
    for step in range(SAVE_AT, SAVE_AT + CONTINUE):
        reports.append(opt.checkpoint_step_boundary())
        train(ddp, opt, rank, world_size, [step])
    reports.append(opt.wait_checkpoint())
    full = params_of(ddp)
    out = {"started": started, "reports": [r for r in reports if r is not None]}
    for kind in ("sync", "async"):
        ddp, opt = build(world_size, 1, "adamw_fp32")
        opt.load_checkpoint(os.path.join(directory, kind))
        opt.set_lr(LR / 2)
        train(ddp, opt, rank, world_size, range(SAVE_AT, SAVE_AT + CONTINUE))
        out[f"{kind}_vs_full"] = max((a - b).abs().max().item() for a, b in zip(full, params_of(ddp)))
    return out


def tp_async_save(rank, world_size, directory):
    """dp (world_size / 2) x tp 2, a torch-TP model (DTensor params) under ZeRO-1: dcp.async_save staged by
    meshddp.DcpStager at SAVE_AT, CONTINUE more steps while it writes; then resumed into a model and
    optimizer built with other initial values and trained the same CONTINUE steps. Returns the largest
    difference from the uninterrupted run's params."""
    side = dist.new_group(backend="gloo")
    dp = world_size // 2
    ddp, opt, dp_rank = build_tp(dp, 0)
    train_tp(ddp, opt, dp_rank, dp, range(SAVE_AT))
    path = os.path.join(directory, "tp_async")
    future = dcp.async_save({"model": ddp.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path,
                            process_group=side, async_stager=meshddp.DcpStager())
    full = train_tp(ddp, opt, dp_rank, dp, range(SAVE_AT, SAVE_AT + CONTINUE))
    future.result()
    ddp, opt, dp_rank = build_tp(dp, 1)
    sd = {"model": ddp.state_dict(), "optim": opt.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    ddp.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    resumed = train_tp(ddp, opt, dp_rank, dp, range(SAVE_AT, SAVE_AT + CONTINUE))
    dist.destroy_process_group(side)
    return max((a - b).abs().max().item() for a, b in zip(full, resumed))
