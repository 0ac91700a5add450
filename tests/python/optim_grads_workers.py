"""Rank functions for test_optim_grads.py: meshddp.DistributedDataParallel under
data_parallel_sharding_strategy='optim_grads' (ZeRO-2) from Python, against 'optim' (ZeRO-1) at the same DP
size and against one process (torch.optim.AdamW on the whole global batch), with and without gradient
accumulation; the gradient storage it holds; its refusals (DTensor models: test_tensor_parallel.py); DCP checkpoints across the strategies."""

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import meshddp

STEPS = 5
GLOBAL_BATCH = 8
LR = 0.01
SAVE_AT = 3  # DCP cases: steps before the save
CONTINUE = 3  # and after the load


class Deep(torch.nn.Module):
    """12 Linear(32, 32) layers (~50 KB of fp32 gradients): with 4 KiB buckets each layer is about one bucket,
    so the two whole-bucket blocks in flight are small beside the shards."""

    def __init__(self, layers=12, width=32):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def global_batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, 32, generator=g), torch.randn(GLOBAL_BATCH, 32, generator=g)


def build(world_size, strategy, seed=0, bucket_bytes=4096):
    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    ddp = meshddp.DistributedDataParallel(Deep(), mesh, config=meshddp.DdpConfig(
        bucket_bytes=bucket_bytes, data_parallel_sharding_strategy=strategy))
    opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="adamw", lr=LR, weight_decay=0.01))
    return ddp, opt


def train(ddp, opt, rank, world_size, steps, micro_batches=1, grads_seen=None):
    """Each step: this rank's rows of the global batch in `micro_batches` slices, the first ones under
    no_sync() (optim_grads still reduce-scatters each into the shards). Returns the global mean losses.
    grads_seen: a list that gets, per step, whether any param's .grad was set after backward."""
    n = GLOBAL_BATCH // world_size
    losses = []
    for step in steps:
        ddp.zero_grad_buffer()
        x, y = global_batch(step)
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        total = torch.zeros(())
        for m, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
            ddp.set_requires_gradient_sync(m == micro_batches - 1)
            loss = F.mse_loss(ddp(xm), ym) / micro_batches
            loss.backward()
            total += loss.detach()
        if grads_seen is not None:
            grads_seen.append(any(p.grad is not None for p in ddp.parameters()))
        opt.step()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    opt.finish_param_sync()
    return losses


def params_of(module):
    return [p.detach().clone() for p in module.parameters()]


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def one_process():
    """The golden: the same model, torch.optim.AdamW on the whole global batch (one mean over it)."""
    torch.manual_seed(0)
    model = Deep()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = global_batch(step)
        F.mse_loss(model(x), y).backward()
        opt.step()
    return params_of(model)


def against_optim_and_one_process(rank, world_size, micro_batches):
    """optim_grads' params after STEPS steps vs optim's and vs one process; gradient storage of both."""
    golden = one_process()
    out = {}
    for strategy in ("optim", "optim_grads"):
        ddp, opt = build(world_size, strategy)
        grads_seen = []
        out[strategy] = {"losses": train(ddp, opt, rank, world_size, range(STEPS), micro_batches, grads_seen),
                         "params": params_of(ddp), "grad_bytes": ddp.grad_buffer_bytes(), "grads_seen": grads_seen,
                         "memory": opt.memory()}
    sharded, zero1 = out["optim_grads"], out["optim"]
    return {"vs_optim": max_diff(sharded["params"], zero1["params"]),
            "vs_one": max_diff(sharded["params"], golden), "optim_vs_one": max_diff(zero1["params"], golden),
            "losses": (zero1["losses"], sharded["losses"]),
            "grad_bytes": (zero1["grad_bytes"], sharded["grad_bytes"]),
            "grads_seen": sharded["grads_seen"], "strategy": ddp.config.data_parallel_sharding_strategy}


class DeepLastUnused(Deep):
    """Deep whose last layer takes no part: the first bucket (the last params) gets no gradient, while the
    later buckets fill the pool's blocks."""

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return x


def first_bucket_without_gradient(rank, world_size):
    """optim_grads vs optim when the first bucket gets no gradient (launched with zeros at finish_grad_sync,
    with every block of the pool in use by later buckets): the params after STEPS steps."""
    out = {}
    for strategy in ("optim", "optim_grads"):
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
        ddp = meshddp.DistributedDataParallel(DeepLastUnused(), mesh, config=meshddp.DdpConfig(
            bucket_bytes=4096, data_parallel_sharding_strategy=strategy))
        opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="adamw", lr=LR))
        train(ddp, opt, rank, world_size, range(STEPS))
        out[strategy] = params_of(ddp)
    return max_diff(out["optim"], out["optim_grads"])


def refusals(rank, world_size):
    """The messages of what optim_grads refuses from Python (each caught, so every rank goes on alike)."""
    ddp, opt = build(world_size, "optim_grads")
    train(ddp, opt, rank, world_size, range(1))
    weight = ddp.module.layers[3].weight
    out = {"getattr": getattr(weight, "main_grad", "absent"), "hasattr": hasattr(weight, "main_grad"),
           "is_parameter": isinstance(weight, torch.nn.Parameter)}
    for what, read in (("attribute", lambda: weight.main_grad), ("method", lambda: ddp.main_grad("layers.3.weight"))):
        try:
            read()
            out[what] = None
        except AttributeError as e:
            out[what] = str(e)
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.1)
    try:
        sgd.step()
        out["torch_optimizer"] = None
    except RuntimeError as e:
        out["torch_optimizer"] = str(e)
    return out


def dcp_save(rank, world_size, directory):
    """SAVE_AT steps under each of optim / optim_grads, then DCP and meshddp's format."""
    out = {}
    for strategy in ("optim", "optim_grads"):
        ddp, opt = build(world_size, strategy)
        out[strategy] = train(ddp, opt, rank, world_size, range(SAVE_AT))
        dcp.save({"model": ddp.state_dict(), "optim": opt.state_dict()},
                 checkpoint_id=os.path.join(directory, strategy, "dcp"))
        opt.save_checkpoint(os.path.join(directory, strategy, "meshddp"))
    return out


def dcp_resume(rank, world_size, directory):
    """Each checkpoint loaded under the other strategy at this DP size (into a model built with other values):
    through DCP and through meshddp's format, CONTINUE steps each; and the uninterrupted run at this size."""
    out = {}
    for saved, loaded in (("optim", "optim_grads"), ("optim_grads", "optim")):
        ddp, opt = build(world_size, loaded)
        full_losses = train(ddp, opt, rank, world_size, range(SAVE_AT + CONTINUE))
        full = params_of(ddp)

        ddp, opt = build(world_size, loaded, seed=1)
        sd = {"model": ddp.state_dict(), "optim": opt.state_dict()}
        dcp.load(sd, checkpoint_id=os.path.join(directory, saved, "dcp"))
        ddp.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        after_load = params_of(ddp)
        dcp_losses = train(ddp, opt, rank, world_size, range(SAVE_AT, SAVE_AT + CONTINUE))
        resumed = params_of(ddp)

        ddp, opt = build(world_size, loaded, seed=2)
        opt.load_checkpoint(os.path.join(directory, saved, "meshddp"))
        own_after_load = params_of(ddp)
        own_losses = train(ddp, opt, rank, world_size, range(SAVE_AT, SAVE_AT + CONTINUE))
        out[f"{saved}->{loaded}"] = {
            "full_losses": full_losses, "dcp_losses": dcp_losses, "own_losses": own_losses,
            "loaded_vs_own": max_diff(after_load, own_after_load),
            "vs_own": max_diff(resumed, params_of(ddp)), "vs_full": max_diff(resumed, full)}
    return out
