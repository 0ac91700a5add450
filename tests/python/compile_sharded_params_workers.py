"""Rank functions for test_compile_sharded_params.py: torch.compile(ddp) under
data_parallel_sharding_strategy='optim_grads_params' (ZeRO-3), with inductor (its kernels read the params' storage
without the dispatcher, which is the case the compiled sections' gathers exist for; aot_eager's ops would pass
the per-op interception and gather anyway), against the same model run eagerly under optim_grads_params and
compiled under 'optim'. A tiny model: every block is exactly one bucket (bucket_bytes = a block's bytes) under
both strategies, so the two compiled runs are split at the same places and compile the same sections."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

import meshddp
from meshddp import compile as meshddp_compile

DIM = 16
BLOCKS = 6
STEPS = 3
# Every block exactly one bucket under both strategies (the test checks each param's bucket is the same in both).
BLOCK_BYTES = 9152


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.up = torch.nn.Linear(DIM, 4 * DIM)
        self.down = torch.nn.Linear(4 * DIM, DIM)
        # A layer scale: the first op of the block's backward reads it in a fused kernel, before any matmul (an
        # extern kernel, which passes the per-op interception and would gather the unit anyway).
        self.scale = torch.nn.Parameter(torch.full((DIM,), 0.5))

    def forward(self, x):
        return x + self.scale * self.down(F.gelu(self.up(self.norm(x))))


class Blocks(torch.nn.Module):
    """FSDP units (the default fsdp_unit_modules): blocks.0 .. blocks.5, one bucket each."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank)
    return torch.randn(8, DIM, generator=g), torch.randn(8, DIM, generator=g)


def _sections(ddp):
    """How many sections BucketSplitter cut each graph it compiled for `ddp` into."""
    for clones in meshddp_compile._split_callbacks.values():
        for wrapper_ref, _, splitter in clones.values():
            if wrapper_ref() is ddp:
                return list(splitter.sections)
    return []


def _train(rank, strategy, compiled):
    torch._dynamo.reset()
    config = meshddp.DdpConfig(bucket_bytes=BLOCK_BYTES, data_parallel_sharding_strategy=strategy)
    ddp = meshddp.DistributedDataParallel(Blocks(), process_group=dist.group.WORLD, config=config)
    opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="adamw", lr=0.01,
                                                                               weight_decay=0.01))
    run = torch.compile(ddp, backend="inductor") if compiled else ddp
    ddp.reset_peak_param_storage()
    losses, storage, graphs = [], [], []
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        x, y = batch(step, rank)
        loss = F.mse_loss(run(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        storage.append(ddp.param_storage_bytes())
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    opt.finish_param_sync()
    out = {"losses": losses, "storage_after_steps": storage, "graphs": graphs, "peak": ddp.peak_param_storage_bytes(),
           "shards": ddp.param_shard_bytes(), "sections": _sections(ddp), "layout": ddp._engine._param_buckets()}
    out["params"] = [t.clone() for t in ddp.state_dict().values()]
    return out


def against_eager_and_optim(rank, world_size):
    """optim_grads_params eager first (an eager forward is refused once compiled code exists in the process),
    then compiled, then 'optim' compiled (its sections hit inductor's cache: the same graphs)."""
    torch._inductor.config.compile_threads = 1  # no compile workers on a shared 2-core machine
    eager = _train(rank, "optim_grads_params", compiled=False)
    compiled = _train(rank, "optim_grads_params", compiled=True)
    zero1 = _train(rank, "optim", compiled=True)

    def diff(a, b):
        return max((x - y).abs().max().item() for x, y in zip(a["params"], b["params"]))

    return {"vs_eager": diff(compiled, eager), "vs_optim": diff(compiled, zero1),
            "losses": {"eager": eager["losses"], "compiled": compiled["losses"], "optim": zero1["losses"]},
            "eager_peak": eager["peak"], "whole": zero1["storage_after_steps"][-1],
            "same_layout": compiled["layout"] == zero1["layout"], "buckets": len({b for _, b in zero1["layout"]}),
            **{k: compiled[k] for k in ("storage_after_steps", "graphs", "peak", "shards", "sections")}}


def refusals(rank, world_size):
    """What torch.compile cannot do under optim_grads_params, each refused at the forward (nothing compiles)."""
    config = meshddp.DdpConfig(bucket_bytes=BLOCK_BYTES, data_parallel_sharding_strategy="optim_grads_params")
    x = torch.ones(2, DIM)
    out = {}
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = False
    try:
        ddp = meshddp.DistributedDataParallel(Blocks(), process_group=dist.group.WORLD, config=config)
        out["unsplit"] = _message(lambda: torch.compile(ddp, backend="inductor", fullgraph=True)(x))
    finally:
        torch._dynamo.config.optimize_ddp = True
    model = Blocks()
    model.blocks[1].compile(backend="inductor")
    ddp = meshddp.DistributedDataParallel(model, process_group=dist.group.WORLD, config=config)
    out["per_block"] = _message(lambda: ddp(x))
    return out


def _message(fn):
    try:
        fn()
    except Exception as e:  # Dynamo may wrap the wrapper's RuntimeError
        return str(e)
    return None
