"""Per-rank bodies of tests/python/test_pipelining_misuse.py: misuse of meshddp.pipelining.PipelineStage
on the MLP of pipelining_workers.py (dp 2 x pp 2), each returning the error message this rank got;
and the V-shaped schedules on one Gloo rank with torch's stage and with meshddp's."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed import pipelining as tpp

import meshddp
import meshddp.pipelining
from pipelining_workers import MICRO, WIDTH, batch, build, train


def microbatches_differ(rank, world_size, broken=None):
    """DP rank 0's pipeline splits its batch into 4 micro-batches, DP rank 1's into 2 (each pipeline
    agrees within itself). broken="no_check": the agreement left out (the run then trains silently)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    stages, wrapped = build(mesh, "1F1B")
    if broken == "no_check":
        for s in stages:
            s._prepare_backward_infra = lambda n, s=s: tpp.PipelineStage._prepare_backward_infra(s, n)
    try:
        train(mesh, stages, wrapped, "1F1B", micro=MICRO if mesh["dp"].get_local_rank() == 0 else MICRO // 2)
    except RuntimeError as e:
        return str(e)
    return None


def grad_reduction_differs(rank, world_size, broken=None):
    """DP rank 0's stages built with grad_reduction="mean", DP rank 1's with "sum" (each pipeline agrees
    within itself): the error message this rank got (None if none). broken="no_check": the agreement
    left out (the run then trains silently)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    stages, wrapped = build(mesh, "1F1B")
    if mesh["dp"].get_local_rank() == 1:
        stages = [meshddp.pipelining.PipelineStage(s.submod, s.stage_index, s.num_stages, s.device,
                                                   group=mesh["pp"].get_group(), grad_reduction="sum") for s in stages]
    for s in stages if broken == "no_check" else []:
        s._prepare_backward_infra = lambda n, s=s: tpp.PipelineStage._prepare_backward_infra(s, n)
    try:
        train(mesh, stages, wrapped, "1F1B")
    except RuntimeError as e:
        return str(e)
    return None


def step_before_finish(rank, world_size, schedule="1F1B", finished=0, broken=None):
    """schedule.step(), then finish_grad_sync on only the first `finished` of this rank's stages, then
    torch's SGD step over all of them. broken="no_guard": the optimizer step guard removed."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    stages, wrapped = build(mesh, schedule)
    sched_cls = tpp.ScheduleInterleaved1F1B if len(stages) > 1 else tpp.Schedule1F1B
    sched = sched_cls(stages if len(stages) > 1 else stages[0], MICRO, loss_fn=F.mse_loss)
    params = [p for _, ddp in wrapped for p in ddp.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    if broken == "no_guard":
        opt._finishes_grad_sync = True  # the guard's own exemption (meshddp's DistributedOptimizer)
    x, y = batch(0, 2)
    x, y = x.chunk(2)[mesh["dp"].get_local_rank()], y.chunk(2)[mesh["dp"].get_local_rank()]
    for _, ddp in wrapped:
        ddp.zero_grad_buffer()
    sched.step(*((x,) if any(s.is_first for s in stages) else ()), target=y if any(s.is_last for s in stages) else None)
    if finished:
        meshddp.pipelining.finalize_model_grads(stages[:finished])
    message = None
    try:
        opt.step()
    except RuntimeError as e:
        message = str(e)
    meshddp.pipelining.finalize_model_grads(stages)  # the collectives every rank launched, finished
    return message


def v_shaped_on_one_rank(rank, world_size, schedule, meshddp_stage):
    """Both stages of a V-shaped schedule on one Gloo rank (world size 1), plain Linear stages in torch's
    PipelineStage or meshddp DDPs in meshddp's. Returns None when the step ran (then the gradients equal
    one process's within 1e-6, else an AssertionError), or the error message."""
    torch.manual_seed(0)
    modules = [torch.nn.Linear(WIDTH, WIDTH) for _ in range(2)]
    ref = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(2)])
    for m, r in zip(modules, ref):
        r.load_state_dict(m.state_dict())
    if meshddp_stage:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        wrapped = [meshddp.DistributedDataParallel(m, mesh, "dp") for m in modules]
        stages = [meshddp.pipelining.PipelineStage(w, i, 2, torch.device("cpu")) for i, w in enumerate(wrapped)]
    else:
        stages = [tpp.PipelineStage(m, i, 2, torch.device("cpu")) for i, m in enumerate(modules)]
    sched = getattr(tpp, "Schedule" + schedule)(stages, 2, loss_fn=F.mse_loss)
    x, y = batch(0, 1)
    try:
        sched.step(x, target=y)
    except RuntimeError as e:
        return str(e)
    if meshddp_stage:
        meshddp.pipelining.finalize_model_grads(stages)
    F.mse_loss(ref(x), y).backward()
    got = [p.grad for m in modules for p in m.parameters()]
    for g, r in zip(got, ref.parameters()):
        torch.testing.assert_close(g, r.grad, rtol=0, atol=1e-6)
    return None
