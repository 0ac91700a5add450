"""Per-rank bodies of test_compile.py: torch.compile of meshddp's wrapper against eager and against torch's
DDP compiled the same way. Tiny models and backend="aot_eager" (the graph split and the autograd
structure are the backend's input, so they prove the point without inductor's compile time)."""

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import meshddp

DIM = 256
BLOCKS = 4
# 1 MiB buckets (torch's DDPOptimizer takes no smaller: its first bucket is 1 MiB): a block's params are 2.1
# MB (its two 1 MiB weights), so about two buckets per block.
BUCKET_BYTES = 1 << 20


class Block(torch.nn.Module):
    """A pre-LN MLP block with a residual (a transformer block without attention)."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.up = torch.nn.Linear(DIM, 4 * DIM)
        self.down = torch.nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Blocks(torch.nn.Module):
    def __init__(self, blocks=BLOCKS):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(blocks))
        self.head = torch.nn.Linear(DIM, DIM)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(step, rank, micro=0):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(8, DIM, generator=g), torch.randn(8, DIM, generator=g)


def config(**fields):
    c = meshddp.DdpConfig()
    c.bucket_bytes = BUCKET_BYTES
    for k, v in fields.items():
        setattr(c, k, v)
    return c


def wrap(kind, model, per_block=False):
    """The model wrapped by `kind` ("meshddp", "torch"); per_block: each block compiled before wrapping."""
    if per_block:
        for block in model.blocks:
            block.compile(backend="aot_eager")
    if kind == "torch":
        return TorchDDP(model, bucket_cap_mb=BUCKET_BYTES / 2**20)
    return meshddp.DistributedDataParallel(model, process_group=dist.group.WORLD, config=config())


def _backward_end_and_launch_starts(prof):
    """(end of the backward's last compute op, launch times of the all-reduces), in us."""
    end, starts = 0.0, []
    for e in prof.events():
        if e.name.startswith("autograd::engine::evaluate_function:") and "AccumulateGrad" not in e.name:
            end = max(end, e.time_range.end)
        elif e.name == "c10d::allreduce_":  # the launch (gloo:all_reduce: when a Gloo thread starts it)
            starts.append(e.time_range.start)
    return end, starts


def _step_counting_overlap(ddp, step, rank):
    x, y = batch(step, rank)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        F.mse_loss(ddp(x), y).backward()
        if isinstance(ddp, meshddp.DistributedDataParallel):
            ddp.finish_grad_sync()
    end, starts = _backward_end_and_launch_starts(prof)
    return sum(s < end for s in starts), len(starts)


def overlaps(rank, world_size):
    """overlap() of every setting, in one run (compiles dominate; a run per setting would fork and import again)."""
    return {name: overlap(rank, world_size, mode, split) for name, mode, split in (
        ("eager", "eager", True), ("compiled", "compiled", True), ("compiled_unsplit", "compiled", False),
        ("per_block", "per_block", True), ("torch_compiled", "torch_compiled", True))}


def overlap(rank, world_size, mode, split=True):
    """All-reduces started before the backward's last compute op ended, and all of them, in step 3
    (steps 0-2 warm up: torch's DDP rebuilds its buckets after step 0). mode: "eager", "compiled"
    (torch.compile of the wrapper), "per_block" (each block compiled before wrapping), or
    "torch_compiled" (torch's DDP, compiled, DDPOptimizer). split=False: optimize_ddp off."""
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = split
    kind = "torch" if mode == "torch_compiled" else "meshddp"
    ddp = wrap(kind, Blocks(), per_block=mode == "per_block")
    run = torch.compile(ddp, backend="aot_eager") if mode in ("compiled", "torch_compiled") else ddp
    for step in range(3):
        if kind == "meshddp":
            ddp.zero_grad_buffer()
        else:
            ddp.zero_grad()
        x, y = batch(step, rank)
        F.mse_loss(run(x), y).backward()
        if kind == "meshddp":
            ddp.finish_grad_sync()
    if kind == "meshddp":
        ddp.zero_grad_buffer()
    else:
        ddp.zero_grad()
    before, total = _step_counting_overlap(run, 3, rank)
    buckets = ddp._engine.num_buckets() if kind == "meshddp" else None
    return {"before_end": before, "launches": total, "buckets": buckets}


# -- exactness ------------------------------------------------------------------------------------
def _train(kind, compiled, steps, rank, accumulate=1, zero1=False, overlap_gather=False, autocast=False):
    """Params after `steps` SGD steps (AdamW for ZeRO-1, meshddp's DistributedOptimizer), and Dynamo's frame
    count after step 2 and at the end (no recompiles)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = Blocks()
    if kind == "torch":
        ddp = TorchDDP(model, bucket_cap_mb=BUCKET_BYTES / 2**20)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    else:
        c = config(use_distributed_optimizer=zero1)
        ddp = meshddp.DistributedDataParallel(model, process_group=dist.group.WORLD, config=c)
        if zero1:
            opt = meshddp.DistributedOptimizer(ddp, meshddp.OptimizerConfig(
                kind="adamw", lr=1e-3, weight_decay=0.0, overlap_param_gather=overlap_gather))
        else:
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    pending = []  # ZeRO-1: the param all-gathers still pending each time compiled code starts
    if compiled and zero1:
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        def counting_pending(gm, _):
            def forward(*args):
                pending.append(ddp._engine.pending_param_gathers())
                return gm(*args)
            return make_boxed_func(forward)

        # aot_eager, with a count at each compiled forward's start (aot_eager's ops pass meshddp's
        # per-op waits in the dispatcher; inductor's kernels do not, so nothing may be pending).
        run = torch.compile(ddp, backend=aot_autograd(fw_compiler=counting_pending))
    else:
        run = torch.compile(ddp, backend="aot_eager") if compiled else ddp
    frames = []
    for step in range(steps):
        if kind == "torch":
            opt.zero_grad()
        else:
            ddp.zero_grad_buffer()
        for micro in range(accumulate):
            x, y = batch(step, rank, micro)
            last = micro == accumulate - 1
            if kind == "torch":
                ctx = ddp.no_sync() if not last else _null()
            else:
                ddp.set_is_last_microbatch(last)
                ctx = _null()
            with ctx, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = F.mse_loss(run(x).float(), y) / accumulate
            loss.backward()
        if kind != "torch" and not zero1:
            ddp.finish_grad_sync()
        opt.step()
        if step == 2:
            frames.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    if kind != "torch" and zero1:
        ddp._engine.finish_param_gathers()
    frames.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return [p.detach().clone() for p in model.parameters()], frames, pending


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def exactness_cases(rank, world_size, cases):
    return {case: exactness(rank, world_size, case) for case in cases}


def exactness(rank, world_size, case):
    """case: "plain", "no_sync" (2 micro-batches), "zero1" (ZeRO-1 with overlap_param_gather, AdamW),
    "bf16" (autocast). Params of meshddp compiled, meshddp eager, torch DDP compiled and eager (where
    torch's DDP applies), and Dynamo's unique graph counts after step 2 and at the end."""
    kw = dict(steps=4, rank=rank)
    if case == "no_sync":
        kw["accumulate"] = 2
    if case == "bf16":
        kw["autocast"] = True
    if case == "zero1":
        kw.update(zero1=True, overlap_gather=True)
        compiled, frames, pending = _train("meshddp", True, **kw)
        eager, _, _ = _train("meshddp", False, **kw)
        return {"compiled": compiled, "eager": eager, "frames": frames, "pending": pending}
    compiled, frames, _ = _train("meshddp", True, **kw)
    eager, _, _ = _train("meshddp", False, **kw)
    torch_compiled, _, _ = _train("torch", True, **kw)
    torch_eager, _, _ = _train("torch", False, **kw)
    return {"compiled": compiled, "eager": eager, "torch_compiled": torch_compiled, "torch_eager": torch_eager,
            "frames": frames}


# -- graphs and breaks ---------------------------------------------------------------------------
def explains(rank, world_size):
    """explain() of each case, split and not."""
    return {(case, split): explain(rank, world_size, case, split)
            for case in ("plain", "zero1", "zero1_overlap") for split in (True, False)}


def explain(rank, world_size, case, split=True):
    """torch._dynamo.explain of the wrapper's forward: (graph count, graph break count, break reasons).
    case: "plain", "zero1" or "zero1_overlap". Run after one step, so ZeRO-1 gathers are pending."""
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = split
    zero1 = case.startswith("zero1")
    ddp = meshddp.DistributedDataParallel(Blocks(), process_group=dist.group.WORLD,
                                          config=config(use_distributed_optimizer=zero1))
    if zero1:
        opt = meshddp.DistributedOptimizer(ddp, meshddp.OptimizerConfig(
            kind="adamw", lr=1e-3, weight_decay=0.0, overlap_param_gather=case == "zero1_overlap"))
        x, y = batch(0, rank)
        F.mse_loss(ddp(x), y).backward()
        opt.step()
    ddp.zero_grad_buffer()
    x, _ = batch(1, rank)
    out = torch._dynamo.explain(ddp)(x)
    reasons = [str(r.reason) for r in out.break_reasons]
    return {"graphs": out.graph_count, "breaks": out.graph_break_count, "reasons": reasons,
            "buckets": ddp._engine.num_buckets()}


def compiled_autograd(rank, world_size):
    """The error text of a compiled step under compiled autograd, or None when it ran."""
    torch._dynamo.reset()
    ddp = meshddp.DistributedDataParallel(Blocks(), process_group=dist.group.WORLD, config=config())
    run = torch.compile(ddp, backend="aot_eager")
    x, y = batch(0, rank)
    torch._dynamo.config.compiled_autograd = True
    try:
        F.mse_loss(run(x), y).backward()
        ddp.finish_grad_sync()
        return None
    except RuntimeError as e:
        return str(e)
    finally:
        torch._dynamo.config.compiled_autograd = False


def compiled_autograd_in_backward(rank, world_size, way):
    """The error text of a step whose backward alone runs under compiled autograd (the forward, compiled or
    not, ran without it), or None when it ran. way: "context" (the wrapper compiled, then its enable()
    context around loss.backward()), "config" (torch._dynamo.config.compiled_autograd set after wrapping and
    after an eager forward, the backward in a torch.compile'd function)."""
    from torch._dynamo import compiled_autograd

    torch._dynamo.reset()
    ddp = meshddp.DistributedDataParallel(Blocks(), process_group=dist.group.WORLD, config=config())
    x, y = batch(0, rank)
    try:
        if way == "context":
            loss = F.mse_loss(torch.compile(ddp, backend="aot_eager")(x), y)
            with compiled_autograd._enable(torch.compile(backend="aot_eager")):
                loss.backward()
        else:
            loss = F.mse_loss(ddp(x), y)
            torch._dynamo.config.compiled_autograd = True
            torch.compile(lambda loss: loss.backward(), backend="aot_eager")(loss)
        ddp.finish_grad_sync()
        return None
    except RuntimeError as e:
        return str(e)
    finally:
        torch._dynamo.config.compiled_autograd = False



def dp_x_tp(rank, world_size):
    """Blocks parallelized with torch TP (up: Colwise, down: Rowwise) over "tp" of a 2 x 2 mesh, wrapped
    over "dp": each rank's local shards after 3 SGD steps, compiled (aot_eager) and eager, and the graph
    count of the compiled run."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model = Blocks()
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        ddp = meshddp.DistributedDataParallel(model, mesh, "dp", config())
        run = torch.compile(ddp, backend="aot_eager") if compiled else ddp
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                ddp.zero_grad_buffer()
                x, y = batch(step, mesh.get_local_rank("dp"))
                F.mse_loss(run(x), y).backward()
                ddp.finish_grad_sync()
                opt.step()
        out[f"warned{compiled}"] = any("DTensor inputs" in str(w.message) for w in caught)
        out[compiled] = [(p.to_local() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]
        out[f"graphs{compiled}"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return {"compiled": out[True], "eager": out[False], "graphs": out["graphsTrue"], "warned": out["warnedTrue"]}


def _head(x, weight, bias):
    return F.linear(x, weight, bias)


class _BlocksWithAHeadFunction(Blocks):
    """Blocks after a head (first, so that its bucket's gather, launched last, is pending when it runs) that
    runs through `head_fn`, a plain function (compiled or not), not a submodule."""

    def forward(self, x):
        x = self.head_fn(x, self.head.weight, self.head.bias)
        for block in self.blocks:
            x = block(x)
        return x


def compiled_function_in_forward(rank, world_size):
    """ZeRO-1 with overlap_param_gather, the forward calling a torch.compile'd function (no compiled
    submodule, the wrapper not compiled) on the head's params: the param all-gathers pending each time
    that compiled code starts, and the params after 4 AdamW steps, compiled and eager."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    out = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        model, pending = _BlocksWithAHeadFunction(), []
        ddp = meshddp.DistributedDataParallel(model, process_group=dist.group.WORLD,
                                              config=config(use_distributed_optimizer=True))
        opt = meshddp.DistributedOptimizer(ddp, meshddp.OptimizerConfig(kind="adamw", lr=1e-3, weight_decay=0.0,
                                                                        overlap_param_gather=True))

        def counting_pending(gm, _):
            def forward(*args):
                pending.append(ddp._engine.pending_param_gathers())
                return gm(*args)
            return make_boxed_func(forward)

        model.head_fn = torch.compile(_head, backend=aot_autograd(fw_compiler=counting_pending)) if compiled else _head
        for step in range(4):
            ddp.zero_grad_buffer()
            x, y = batch(step, rank)
            F.mse_loss(ddp(x), y).backward()
            opt.step()
        ddp._engine.finish_param_gathers()
        out[compiled] = [p.detach().clone() for p in model.parameters()]
        out[f"pending{compiled}"] = pending
    return {"compiled": out[True], "eager": out[False], "pending": out["pendingTrue"]}
