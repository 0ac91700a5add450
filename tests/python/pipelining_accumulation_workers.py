"""Per-rank bodies of tests/python/test_pipelining_accumulation.py: gradient accumulation across
schedule.step() calls (two pipeline steps, one optimizer step) with meshddp.pipelining.PipelineStage,
on the MLP of pipelining_workers.py over dp 2 x pp 2 (4 Gloo ranks). Golden: the whole model in one
process, the two steps' losses (each the mean over its global batch) summed, plain SGD."""

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import meshddp
import meshddp.pipelining
from pipelining_workers import LR, MICRO, SCHEDULES, batch, build, full_model

ACCUMULATE, OPT_STEPS = 2, 2


def golden(dp_size):
    model = full_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(OPT_STEPS):
        opt.zero_grad()
        for k in range(ACCUMULATE):
            x, y = batch(step * ACCUMULATE + k, dp_size)
            F.mse_loss(model(x), y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    return grads, [p.detach().clone() for p in model.parameters()]


def _end(ending, stages, wrapped):
    """Ends an accumulation's last schedule.step(): "stage" (meshddp.pipelining.finalize_model_grads(stages)),
    "ddp" (each chunk's DDP finish_grad_sync(), plain DDP's habit), each of them "_twice", or "optimizer"
    (nothing: DistributedOptimizer.step() finishes the sync itself)."""
    for _ in range(2 if ending.endswith("_twice") else 1):
        if ending.startswith("stage"):
            meshddp.pipelining.finalize_model_grads(stages)
        elif ending.startswith("ddp"):
            for _, ddp in wrapped:
                ddp.finish_grad_sync()


def accumulated(rank, world_size, schedule="1F1B", finish_between=False, scale_grads=True, zero1=False,
                eval_between=False, ending="stage", grad_reduction="mean", discard_first=False, broken=None,
                strategy=""):
    """(max |grad - golden|, max |param - golden|) over this rank's params after OPT_STEPS optimizer steps,
    each over ACCUMULATE schedule.step() calls; finish_between: meshddp.pipelining.finalize_model_grads(stages)
    after every schedule.step(), not only the last; eval_between: a schedule.eval() on the step's batch after
    every schedule.step() but the last (forward only; it must not disturb the accumulation); ending: how the
    last schedule.step() of an optimizer step is finished (_end); grad_reduction="sum": the loss divided by
    the global batch's micro-batch count (MICRO x DP size; scale_grads off); discard_first: first an
    accumulation on other batches, finished with each DDP's finish_grad_sync() and discarded (the loop's
    zero_grad_buffer(), as after a NaN loss). Returns the error message instead when one is raised.
    broken="no_add_back": the earlier steps' gradients set aside at a step's start and never added back.
    strategy: DdpConfig.data_parallel_sharding_strategy of every chunk (with zero1)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dp_size, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    stages, wrapped = build(mesh, schedule, zero1=zero1, grad_reduction=grad_reduction, strategy=strategy)
    for s in stages if broken == "no_add_back" else []:
        resume = s._resume_accumulation
        s._resume_accumulation = lambda s=s, resume=resume: (resume(), setattr(s.submod, "_set_aside", None))
    cls, chunks = SCHEDULES[schedule]
    if grad_reduction == "sum":
        scale_grads = False
        loss_fn = lambda out, y: F.mse_loss(out, y) / (MICRO * dp_size)  # noqa: E731
    else:
        loss_fn = F.mse_loss if scale_grads else (lambda out, y: F.mse_loss(out, y) / MICRO)
    sched = cls(stages if chunks > 1 else stages[0], MICRO, loss_fn=loss_fn, scale_grads=scale_grads)
    params = [p for _, ddp in wrapped for p in ddp.parameters()]
    opts = ([meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="sgd", lr=LR)) for _, ddp in wrapped]
            if zero1 else [torch.optim.SGD(params, lr=LR)])
    has_first, has_last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    try:
        for k in range(ACCUMULATE if discard_first else 0):
            x, y = batch(100 + k, dp_size)
            x, y = x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]
            sched.step(*((x,) if has_first else ()), target=y if has_last else None)
        if discard_first:
            _end("ddp", stages, wrapped)
        for step in range(OPT_STEPS):
            for _, ddp in wrapped:
                ddp.zero_grad_buffer()
            for k in range(ACCUMULATE):
                x, y = batch(step * ACCUMULATE + k, dp_size)
                x, y = x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]
                sched.step(*((x,) if has_first else ()), target=y if has_last else None)
                if eval_between and k < ACCUMULATE - 1:
                    sched.eval(*((x,) if has_first else ()), target=y if has_last else None)
                if finish_between and k < ACCUMULATE - 1:
                    meshddp.pipelining.finalize_model_grads(stages)
                if k == ACCUMULATE - 1:
                    _end(ending, stages, wrapped)
            # With ending="optimizer" the gradients are final only inside step(): the params tell.
            grads = None if ending == "optimizer" else [p.grad.clone() for p in params]
            if zero1:  # one step over every chunk this rank holds: one norm, one skip decision
                meshddp.DistributedOptimizer.step_together(opts)
            else:
                opts[0].step()
    except RuntimeError as e:
        return " <- ".join(str(c) for c in (e, e.__cause__, e.__context__) if c is not None)
    ref_grads, ref_params = golden(dp_size)
    per_stage = len(ref_grads) // (2 * mesh["pp"].size() * chunks)  # params (weight, bias) per stage: 2 x blocks
    mine = [2 * index * per_stage + j for index, _ in wrapped for j in range(2 * per_stage)]
    return (0.0 if grads is None else max((g - ref_grads[i]).abs().max().item() for g, i in zip(grads, mine)),
            max((p - ref_params[i]).abs().max().item() for p, i in zip([p.detach() for p in params], mine)))


def step_without_zeroing(rank, world_size, zero1=False):
    """schedule.step(), finish_grad_sync, SGD step (zero1: meshddp's ZeRO-1 DistributedOptimizer), then
    schedule.step() again without zero_grad_buffer(): the error message this rank got (None if none)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dp_size, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    stages, wrapped = build(mesh, "1F1B", zero1=zero1)
    sched = SCHEDULES["1F1B"][0](stages[0], MICRO, loss_fn=F.mse_loss)
    opt = (meshddp.DistributedOptimizer(wrapped[0][1], meshddp.DistributedOptimizerConfig(kind="sgd", lr=LR)) if zero1 else
           torch.optim.SGD([p for _, ddp in wrapped for p in ddp.parameters()], lr=LR))
    x, y = batch(0, dp_size)
    x, y = x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]
    args = dict(target=y) if stages[0].is_last else {}
    try:
        for _ in range(2):
            sched.step(*((x,) if stages[0].is_first else ()), **args)
            meshddp.pipelining.finalize_model_grads(stages)
            opt.step()
    except RuntimeError as e:
        return str(e)
    return None
