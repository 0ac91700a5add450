"""Per-rank bodies of tests/python/test_pipelining.py: a 4-layer MLP split into pipeline stages run by
torch.distributed.pipelining schedules over dp 2 x pp 2 (4 ranks), every stage chunk a
meshddp.DistributedDataParallel inside a meshddp.pipelining.PipelineStage. Golden: the whole model in
one process on the global batch (mean MSE), plain SGD (every rank computes it)."""

import copy

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed import pipelining as tpp
from torch.distributed.pipelining._backward import stage_backward_weight

import meshddp
import meshddp.pipelining

WIDTH, LOCAL_BATCH, MICRO, STEPS, LR, LAYERS = 6, 8, 4, 3, 0.2, 4


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.tanh(self.fc(x))


def full_model():
    torch.manual_seed(31)
    return torch.nn.Sequential(*[Block() for _ in range(LAYERS)])


def batch(step, dp_size):
    g = torch.Generator().manual_seed(3100 + step)
    rows = LOCAL_BATCH * dp_size
    return torch.randn(rows, WIDTH, generator=g), torch.randn(rows, WIDTH, generator=g)


def golden(dp_size):
    model = full_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, dp_size)
        F.mse_loss(model(x), y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    return model, grads  # the last step's grads


SCHEDULES = {"GPipe": (tpp.ScheduleGPipe, 1), "1F1B": (tpp.Schedule1F1B, 1),
             "Interleaved1F1B": (tpp.ScheduleInterleaved1F1B, 2),
             "InterleavedZeroBubble": (tpp.ScheduleInterleavedZeroBubble, 2),
             "ZBVZeroBubble": (tpp.ScheduleZBVZeroBubble, 2), "DualPipeV": (tpp.ScheduleDualPipeV, 2)}
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")  # rank r holds stages r and 2 pp - 1 - r


def build(mesh, schedule, zero1=False, torch_ddp=False, grad_reduction="mean", strategy=""):
    """This rank's stages of the MLP for `schedule` (a list, one per chunk) and their (stage index,
    wrapper) pairs: meshddp DDPs in meshddp stages (with `grad_reduction`), or with torch_ddp torch's DDP
    in torch's stage."""
    pp_size, pp_rank = mesh["pp"].size(), mesh["pp"].get_local_rank()
    _, chunks = SCHEDULES[schedule]
    num_stages = pp_size * chunks
    per_stage = LAYERS // num_stages
    layers = full_model()
    stages, wrapped = [], []
    for k in range(chunks):
        # torch's interleaved placement: rank r holds stages r, r + pp, ...; V-shaped: r and 2 pp - 1 - r.
        index = (pp_rank if k == 0 else 2 * pp_size - 1 - pp_rank) if schedule in V_SHAPED else pp_rank + k * pp_size
        module = torch.nn.Sequential(*copy.deepcopy(list(layers[index * per_stage:(index + 1) * per_stage])))
        if torch_ddp:
            ddp = torch.nn.parallel.DistributedDataParallel(module, process_group=mesh["dp"].get_group())
            stage_cls = tpp.PipelineStage
        else:
            config = meshddp.DdpConfig(bucket_bytes=64, use_distributed_optimizer=zero1,
                                       data_parallel_sharding_strategy=strategy)
            ddp = meshddp.DistributedDataParallel(module, mesh, dp_dim="dp", config=config)
            stage_cls = meshddp.pipelining.PipelineStage
        extra = {} if torch_ddp else {"grad_reduction": grad_reduction}
        stages.append(stage_cls(ddp, index, num_stages, torch.device("cpu"), group=mesh["pp"].get_group(), **extra))
        wrapped.append((index, ddp))
    return stages, wrapped


def whole_params(wrapped):
    """Copies of the params in (stage index, parameter) order; under optim_grads_params ddp.state_dict()
    gathers them (a collective over the chunk's DP group: every rank reads them)."""
    return [t.detach().clone() for _, ddp in wrapped
            for t in (ddp.state_dict().values() if getattr(ddp, "_shards_params", False) else ddp.parameters())]


def train(mesh, stages, wrapped, schedule, scale_grads=True, zero1=False, micro=MICRO, storage=None):
    """STEPS SGD steps of `stages` on this DP rank's share of the global batches; returns the last step's
    gradients (clones, after the sync) and the params, in (stage index, parameter) order. storage: a list
    that gets, each step, each chunk's param_storage_bytes() after the sync and after the optimizer step, and
    its peak_param_storage_bytes() in the step."""
    dp_size, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    cls, chunks = SCHEDULES[schedule]
    meshddp_stages = isinstance(stages[0], meshddp.pipelining.PipelineStage)
    # Mean loss per micro-batch with scale_grads=True; a loss pre-divided by the micro-batch count without.
    loss_fn = (lambda out, y: F.mse_loss(out, y)) if scale_grads else (lambda out, y: F.mse_loss(out, y) / micro)
    sched = cls(stages if chunks > 1 else stages[0], micro, loss_fn=loss_fn, scale_grads=scale_grads)
    params = [p for _, ddp in wrapped for p in ddp.parameters()]
    opts = ([meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="sgd", lr=LR)) for _, ddp in wrapped]
            if zero1 else [torch.optim.SGD(params, lr=LR)])
    has_first = any(s.is_first for s in stages)
    has_last = any(s.is_last for s in stages)
    for step in range(STEPS):
        for _, ddp in wrapped:
            if meshddp_stages:
                ddp.zero_grad_buffer()
            else:
                ddp.zero_grad(set_to_none=True)
        x, y = batch(step, dp_size)
        x, y = x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]
        args = (x,) if has_first else ()
        sched.step(*args, target=y if has_last else None)
        if meshddp_stages:
            meshddp.pipelining.finalize_model_grads(stages)
        synced = [ddp.param_storage_bytes() for _, ddp in wrapped] if storage is not None else None
        # optim_grads: no whole gradient (.grad is None): NaN, and the caller compares params only.
        grads = [p.grad.clone() if p.grad is not None else torch.full(p.shape, float("nan")) for p in params]
        if zero1:  # one step over every chunk this rank holds: one norm, one skip decision
            meshddp.DistributedOptimizer.step_together(opts)
        else:
            opts[0].step()
        if storage is not None:
            storage.append((synced, [ddp.param_storage_bytes() for _, ddp in wrapped],
                            [ddp.peak_param_storage_bytes() for _, ddp in wrapped]))
            for _, ddp in wrapped:
                ddp.reset_peak_param_storage()
    return grads, whole_params(wrapped)


def pipelined(rank, world_size, schedule="1F1B", scale_grads=True, broken=None, zero1=False, strategy=""):
    """(max |grad - golden grad| of the last step, max |param - golden|) over this rank's params.
    zero1: each chunk's SGD a meshddp.DistributedOptimizer (ZeRO-1) instead of torch's; strategy:
    DdpConfig.data_parallel_sharding_strategy (with zero1; "optim_grads": the grad difference is NaN, no
    whole gradient exists); broken: a way to break the stage on purpose ("no_scale", "no_hold", "self_p2p":
    torch's warm-up sends to this rank itself kept, "torch_weight_pass": torch's weight pass, `weight.grad +=
    dw` past the buffer's hooks)."""
    dp_size, pp_size = 2, 2
    mesh = init_device_mesh("cpu", (dp_size, pp_size), mesh_dim_names=("dp", "pp"))
    stages, wrapped = build(mesh, schedule, zero1=zero1, strategy=strategy)
    for s in stages if broken else []:  # on purpose, to see the test fail
        if broken == "no_scale":  # the sync started, the buffers never scaled
            s.scale_grads = lambda f, s=s: s.submod.start_grad_sync()
        elif broken == "self_p2p":
            s._get_init_p2p_neighbors_ops = lambda s=s: tpp.PipelineStage._get_init_p2p_neighbors_ops(s)
        elif broken == "torch_weight_pass":
            s._backward_weight = lambda groups, s=s: stage_backward_weight(s.submod.parameters(), groups)
        elif broken == "no_hold":  # torch's plain backward: buckets launch during the first micro-batch
            s.backward_maybe_with_nosync = lambda t, kw, last_backward=False, s=s: (
                tpp.PipelineStage.backward_maybe_with_nosync(s, t, kw, last_backward))
    grads, params = train(mesh, stages, wrapped, schedule, scale_grads=scale_grads, zero1=zero1)
    ref_params, ref_grads = golden_of(wrapped, schedule, dp_size, pp_size)
    return (max((g - r).abs().max().item() for g, r in zip(grads, ref_grads)),
            max((p - r).abs().max().item() for p, r in zip(params, ref_params)))


def golden_of(wrapped, schedule, dp_size, pp_size):
    """The golden's params after STEPS steps and its last step's grads, for this rank's chunks (`wrapped`), in
    train()'s (stage index, parameter) order."""
    ref, ref_grads = golden(dp_size)
    blocks = blocks_of(wrapped, schedule, pp_size)
    return params_of(ref, blocks), [ref_grads[2 * b + k] for b in blocks for k in (0, 1)]


def blocks_of(wrapped, schedule, pp_size):
    """The indices of the MLP's blocks in this rank's chunks (`wrapped`), in order."""
    per_stage = LAYERS // (pp_size * SCHEDULES[schedule][1])
    return [b for index, _ in wrapped for b in range(index * per_stage, (index + 1) * per_stage)]


def params_of(model, blocks):
    """The params of `model`'s `blocks` (whole model), in train()'s order."""
    return [getattr(model[b].fc, name).detach() for b in blocks for name in ("weight", "bias")]


def versus_optim(rank, world_size, schedule="1F1B"):
    """The pipeline trained three times on this rank (ZeRO-1 SGD through meshddp.DistributedOptimizer), its
    chunks under data_parallel_sharding_strategy 'optim', 'optim_grads' and 'optim_grads_params': {"vs_optim",
    "vs_optim_grads": max |param - that run's param| of the optim_grads_params run, "vs_one": the same against
    the golden, "optim_vs_one": optim's against the golden, "storage": each step's param_storage_bytes() of each
    chunk (after the sync, after the optimizer step; its peak in the step), "shards": each chunk's
    param_shard_bytes(), "whole": each chunk's param storage under optim}."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    runs = {}
    for strategy in ("optim", "optim_grads", "optim_grads_params"):
        stages, wrapped = build(mesh, schedule, zero1=True, strategy=strategy)
        storage = []
        _, params = train(mesh, stages, wrapped, schedule, zero1=True, storage=storage)
        runs[strategy] = params, storage
    ref, _ = golden_of(wrapped, schedule, 2, 2)
    mine, storage = runs["optim_grads_params"]
    worst = lambda a, b: max((x - y).abs().max().item() for x, y in zip(a, b))  # noqa: E731
    return {"vs_optim": worst(mine, runs["optim"][0]), "vs_optim_grads": worst(mine, runs["optim_grads"][0]),
            "vs_one": worst(mine, ref), "optim_vs_one": worst(runs["optim"][0], ref), "storage": storage,
            "shards": [ddp.param_shard_bytes() for _, ddp in wrapped], "whole": runs["optim"][1][-1][1]}


def versus_torch_ddp(rank, world_size, schedule="1F1B", broken=None):
    """(max |grad - torch's|, max |param - torch's|): the same pipeline trained twice on this rank, once
    with meshddp stages, once with torch's DDP in torch's PipelineStage (the second golden).
    broken="no_scale": meshddp's buffers never divided by the micro-batch count."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    theirs = train(mesh, *build(mesh, schedule, torch_ddp=True), schedule)
    stages, wrapped = build(mesh, schedule)
    for s in stages if broken == "no_scale" else []:
        s.scale_grads = lambda f, s=s: s.submod.start_grad_sync()
    ours = train(mesh, stages, wrapped, schedule)
    return tuple(max((a - b).abs().max().item() for a, b in zip(o, t)) for o, t in zip(ours, theirs))
