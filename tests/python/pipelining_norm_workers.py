"""Per-rank bodies of tests/python/test_pipelining_norm.py: the MLP of pipelining_workers.py under torch's
schedules over dp 2 x pp 2 (4 ranks), clipped by the whole pipeline's gradient norm (meshddp.clip_grad_norm_
over every chunk of the rank, or OptimizerConfig(clip_grad_norm=...) with DistributedOptimizer.step_together),
against one process clipping with torch.nn.utils.clip_grad_norm_; a NaN on one stage skipped by every stage;
a norm or a step over part of a rank's chunks refused; stages clipping to other bounds refused; a second
model on the same mesh not counted as a chunk."""

import math

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import meshddp
import meshddp.pipelining
from pipelining_workers import LR, MICRO, SCHEDULES, STEPS, batch, blocks_of, build, full_model, params_of, whole_params

MAX_NORM = 0.05  # below every step's norm (measured 0.3-0.6): each step is clipped


def golden(dp_size):
    """One process on the global batch: the norms before clipping, and the blocks after STEPS steps."""
    model = full_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, dp_size)
        F.mse_loss(model(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
    return norms, model


def _mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))


def _step_inputs(mesh, stages, step):
    dp_size, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    x, y = batch(step, dp_size)
    x, y = x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]
    has_first, has_last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    return ((x,) if has_first else ()), dict(target=y if has_last else None)


def clipped(rank, world_size, schedule="1F1B", zero1=False, strategy=""):
    """(this rank's norms, golden norms, max |param - golden| over this rank's blocks); strategy: every chunk's
    DdpConfig.data_parallel_sharding_strategy (with zero1)."""
    mesh = _mesh()
    stages, wrapped = build(mesh, schedule, zero1=zero1, strategy=strategy)
    cls, chunks = SCHEDULES[schedule]
    sched = cls(stages if chunks > 1 else stages[0], MICRO, loss_fn=F.mse_loss)
    ddps = [ddp for _, ddp in wrapped]
    if zero1:
        config = meshddp.DistributedOptimizerConfig(kind="sgd", lr=LR, clip_grad_norm=MAX_NORM)
        opts = [meshddp.DistributedOptimizer(ddp, config) for ddp in ddps]
    else:
        opt = torch.optim.SGD([p for ddp in ddps for p in ddp.parameters()], lr=LR)
    norms = []
    for step in range(STEPS):
        for ddp in ddps:
            ddp.zero_grad_buffer()
        args, kwargs = _step_inputs(mesh, stages, step)
        sched.step(*args, **kwargs)
        meshddp.pipelining.finalize_model_grads(stages)
        if zero1:
            result = meshddp.DistributedOptimizer.step_together(opts)
            assert result.clipped and not result.skipped, result
            norms.append(result.grad_norm)
        else:
            norms.append(meshddp.clip_grad_norm_(ddps, MAX_NORM).item())
            opt.step()
    ref_norms, ref = golden(mesh["dp"].size())
    mine = whole_params(wrapped)  # under optim_grads_params gathered by state_dict(): every rank reads them
    ref_params = params_of(ref, blocks_of(wrapped, schedule, mesh["pp"].size()))
    worst = max((p - q).abs().max().item() for p, q in zip(mine, ref_params))
    return norms, ref_norms, worst


def nan_on_one_stage(rank, world_size, schedule="Interleaved1F1B", nan_rank=3):
    """ZeRO-1, a NaN in one gradient element of global rank `nan_rank`'s first chunk at step 1: (skipped per
    step, whether every param is unchanged by that step, the report of the skipped step)."""
    mesh = _mesh()
    stages, wrapped = build(mesh, schedule, zero1=True)
    cls, chunks = SCHEDULES[schedule]
    sched = cls(stages if chunks > 1 else stages[0], MICRO, loss_fn=F.mse_loss)
    ddps = [ddp for _, ddp in wrapped]
    opts = [meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="sgd", lr=LR)) for ddp in ddps]
    skipped, unchanged, report = [], None, ""
    for step in range(STEPS):
        for ddp in ddps:
            ddp.zero_grad_buffer()
        hook = None
        if step == 1 and rank == nan_rank:
            first = next(iter(ddps[0].module.parameters()))
            hook = first.register_hook(lambda g: g.clone().view(-1).index_fill_(0, torch.tensor([0]), math.nan)
                                       .view(g.shape))
        args, kwargs = _step_inputs(mesh, stages, step)
        sched.step(*args, **kwargs)
        meshddp.pipelining.finalize_model_grads(stages)
        if hook is not None:
            hook.remove()
        before = [p.detach().clone() for ddp in ddps for p in ddp.parameters()]
        result = meshddp.DistributedOptimizer.step_together(opts)
        for opt in opts:
            opt.finish_param_sync()
        skipped.append(result.skipped)
        if step == 1:
            after = [p.detach() for ddp in ddps for p in ddp.parameters()]
            unchanged = all(torch.equal(a, b) for a, b in zip(before, after))
            report = result.report
    return skipped, unchanged, report


def part_of_the_chunks(rank, world_size, zero1=False):
    """Interleaved1F1B (2 chunks per rank): the norm (plain) or the step (ZeRO-1) of the first chunk alone;
    returns the error message."""
    mesh = _mesh()
    stages, wrapped = build(mesh, "Interleaved1F1B", zero1=zero1)
    sched = SCHEDULES["Interleaved1F1B"][0](stages, MICRO, loss_fn=F.mse_loss)
    ddps = [ddp for _, ddp in wrapped]
    opts = [meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="sgd", lr=LR)) for ddp in ddps] if zero1 \
        else None
    for ddp in ddps:
        ddp.zero_grad_buffer()
    args, kwargs = _step_inputs(mesh, stages, 0)
    sched.step(*args, **kwargs)
    meshddp.pipelining.finalize_model_grads(stages)
    try:
        if zero1:
            opts[0].step()
        else:
            meshddp.grad_norm(ddps[0])
    except RuntimeError as e:
        return str(e)
    return None


def clip_differs(rank, world_size, zero1=False):
    """1F1B, the last stage clipping to twice the first's bound: the error message this rank got."""
    mesh = _mesh()
    stages, wrapped = build(mesh, "1F1B", zero1=zero1)
    sched = SCHEDULES["1F1B"][0](stages[0], MICRO, loss_fn=F.mse_loss)
    ddps = [ddp for _, ddp in wrapped]
    bound = MAX_NORM * (1 + mesh["pp"].get_local_rank())
    if zero1:
        opts = [meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="sgd", lr=LR, clip_grad_norm=bound))
                for ddp in ddps]
    args, kwargs = _step_inputs(mesh, stages, 0)
    sched.step(*args, **kwargs)
    meshddp.pipelining.finalize_model_grads(stages)
    try:
        if zero1:
            meshddp.DistributedOptimizer.step_together(opts)
        else:
            meshddp.clip_grad_norm_(ddps, bound)
    except RuntimeError as e:
        return str(e)
    return None


def a_second_model(rank, world_size):
    """Two models pipelined over the same mesh (a trained one and, e.g., a frozen reference): the norm of
    the first's one chunk per rank is neither refused nor changed by the second. (norm, golden norm)."""
    mesh = _mesh()
    stages, wrapped = build(mesh, "1F1B")
    _other = build(mesh, "1F1B")  # noqa: F841 (kept alive beside the first)
    sched = SCHEDULES["1F1B"][0](stages[0], MICRO, loss_fn=F.mse_loss)
    ddps = [ddp for _, ddp in wrapped]
    for ddp in ddps:
        ddp.zero_grad_buffer()
    args, kwargs = _step_inputs(mesh, stages, 0)
    sched.step(*args, **kwargs)
    meshddp.pipelining.finalize_model_grads(stages)
    return meshddp.grad_norm(ddps), golden(mesh["dp"].size())[0][0]
