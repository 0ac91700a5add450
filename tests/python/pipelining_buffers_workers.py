"""Per-rank bodies of tests/python/test_pipelining_buffers.py: a model whose forward multiplies by a
buffer that autograd saves for backward (a rotary-embedding table, such as torchtitan's freqs_cis),
split into 2 stages run by torch's Schedule1F1B over dp 2 x pp 2 (4 Gloo ranks), each stage a
meshddp.DistributedDataParallel (broadcast_buffers on, the default) inside a
meshddp.pipelining.PipelineStage. Golden: the whole model in one process on the global batch, plain SGD."""

import copy

import torch
import torch.nn.functional as F
from torch.distributed import pipelining as tpp
from torch.distributed.device_mesh import init_device_mesh

import meshddp
import meshddp.pipelining

WIDTH, LOCAL_BATCH, MICRO, LR, LAYERS, OPT_STEPS = 6, 8, 4, 0.2, 4, 2


class Rotated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(WIDTH, WIDTH)
        self.register_buffer("table", torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, x):
        return torch.tanh(self.fc(x) * self.table)  # the product saves the table for backward


def full_model():
    torch.manual_seed(41)
    return torch.nn.Sequential(*[Rotated() for _ in range(LAYERS)])


def batch(step, dp_size):
    g = torch.Generator().manual_seed(4100 + step)
    rows = LOCAL_BATCH * dp_size
    return torch.randn(rows, WIDTH, generator=g), torch.randn(rows, WIDTH, generator=g)


def golden(dp_size, accumulate):
    model = full_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(OPT_STEPS):
        opt.zero_grad()
        for k in range(accumulate):
            x, y = batch(step * accumulate + k, dp_size)
            F.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def rotated_pipeline(rank, world_size, accumulate=1):
    """(max |param - golden| over this stage's params after OPT_STEPS SGD steps, each of `accumulate`
    schedule.step() calls; whether each optimizer step broadcast the buffers once: the broadcast due at
    its first schedule.step() and not at the later ones). DP rank 1's tables drift after every optimizer
    step (as running statistics would), so the step's broadcast must bring back DP rank 0's."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dp_size, dp_rank, pp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    module = copy.deepcopy(full_model()[2 * pp_rank:2 * pp_rank + 2])
    ddp = meshddp.DistributedDataParallel(module, mesh, "dp")
    stage = meshddp.pipelining.PipelineStage(ddp, pp_rank, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    due = []  # the broadcast due at each schedule.step()'s start
    clear = stage.clear_runtime_states
    stage.clear_runtime_states = lambda: (clear(), due.append(ddp._engine.buffers_broadcast_due()))[0]
    sched = tpp.Schedule1F1B(stage, MICRO, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(list(ddp.parameters()), lr=LR)
    for step in range(OPT_STEPS):
        ddp.zero_grad_buffer()
        for k in range(accumulate):
            x, y = batch(step * accumulate + k, dp_size)
            x, y = x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]
            sched.step(*((x,) if stage.is_first else ()), target=y if stage.is_last else None)
        meshddp.pipelining.finalize_model_grads(stage)
        opt.step()
        if dp_rank == 1:
            with torch.no_grad():
                for block in module:
                    block.table.add_(0.25)
    mine = [p.detach() for p in ddp.parameters()]
    want = golden(dp_size, accumulate)[4 * pp_rank:4 * pp_rank + 4]
    once = due == [True] + [False] * (accumulate - 1) + ([True] + [False] * (accumulate - 1)) * (OPT_STEPS - 1)
    return max((a - b).abs().max().item() for a, b in zip(mine, want)), once
