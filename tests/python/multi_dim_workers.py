"""Per-rank bodies of tests/python/test_multi_dim_dp.py: meshddp.DistributedDataParallel over several
DP dims of a torch DeviceMesh (dp_dim=("dp", "cp")), against one process on the same global batch.

Context parallel splits every sequence of a batch into contiguous slices, one per CP rank; DP splits
the batch. The models here are per-token (an MLP; a LayerNorm + MLP block), so a rank's loss is the
mean over its own (batch rows, sequence slice), and with equal slices the mean of the dp*cp local
means is the global batch's mean: the one-process gradient, if and only if every gradient is averaged
over the flattened DP x CP group."""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import meshddp
from workers import Block, Net, full, make_optimizer, max_diff

STEPS = 5
ROWS = 2  # batch rows per DP rank
TOKENS = 3  # sequence positions per CP rank


def global_batch(step, dp, cp, dim_in, dim_out):
    """The whole batch: (dp * ROWS, cp * TOKENS, dim) inputs and targets."""
    g = torch.Generator().manual_seed(500 + step)
    shape = (dp * ROWS, cp * TOKENS)
    return torch.randn(*shape, dim_in, generator=g), torch.randn(*shape, dim_out, generator=g)


def local_slice(t, dp_rank, cp_rank):
    """This (DP, CP) rank's batch rows and contiguous sequence slice."""
    return t[dp_rank * ROWS:(dp_rank + 1) * ROWS, cp_rank * TOKENS:(cp_rank + 1) * TOKENS]


def train_vs_single(mesh, model, golden, optimizer, dim_in, dim_out):
    """Trains `model` wrapped in DDP over ("dp", "cp") of `mesh`, and `golden` (the same model,
    unparallelized) in one process on the global batch, STEPS steps. optimizer: sgd (torch's, with
    momentum) | zero1 (meshddp's AdamW). Returns the first step's gradient difference (None with
    ZeRO-1: only this rank's shard is synced), the params' difference after the last step, the
    engine's DP ranks, its TP dim and the DTensor params."""
    zero1 = optimizer == "zero1"
    device = next(golden.parameters()).device
    ddp = meshddp.DistributedDataParallel(model, mesh, ("dp", "cp"),
                                          meshddp.DdpConfig(bucket_bytes=512, use_distributed_optimizer=zero1))
    if zero1:
        opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="adamw", lr=0.01, weight_decay=0.01))
        opt_golden = torch.optim.AdamW(golden.parameters(), lr=0.01, weight_decay=0.01, foreach=False)
    else:
        opt = make_optimizer("sgd", ddp.parameters(), 0.0)
        opt_golden = make_optimizer("sgd", golden.parameters(), 0.0)
    names = mesh.mesh_dim_names
    dp, cp = mesh.size(names.index("dp")), mesh.size(names.index("cp"))
    dp_rank, cp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("cp")
    grad_diff = None
    for step in range(STEPS):
        x, y = (t.to(device) for t in global_batch(step, dp, cp, dim_in, dim_out))
        ddp.zero_grad_buffer()
        F.mse_loss(ddp(local_slice(x, dp_rank, cp_rank)), local_slice(y, dp_rank, cp_rank)).backward()
        ddp.finish_grad_sync()
        opt_golden.zero_grad()
        F.mse_loss(golden(x), y).backward()
        if step == 0 and not zero1:
            grad_diff = max_diff([full(p.grad) for p in ddp.parameters()], [p.grad for p in golden.parameters()])
        opt.step()
        opt_golden.step()
    if zero1:
        opt.finish_param_sync()
    return {
        "grad_diff": grad_diff,
        "param_diff": max_diff([full(p) for p in ddp.parameters()], list(golden.parameters())),
        "dp_ranks": dist.get_process_group_ranks(ddp._dp_group),
        "tp_dim": ddp.tp_dim,
        "dtensor_params": sorted(n for n, p in ddp.named_parameters() if isinstance(p, DTensor)),
    }


def error_of(fn):
    try:
        fn()
    except (RuntimeError, TypeError) as e:
        return str(e)
    return "(no error)"


def multi_dim_suite(rank, world_size):
    """On 4 ranks: dp 2 x cp 2 (the MLP; torch SGD and meshddp ZeRO-1), cp 2 x tp 2 on a dp 1 x
    cp 2 x tp 2 mesh (the Block with torch TP), and the errors for badly named DP dims."""
    out = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    for optimizer in ("sgd", "zero1"):
        torch.manual_seed(0)
        model = Net()
        out[("dp_x_cp", optimizer)] = train_vs_single(mesh, model, copy.deepcopy(model), optimizer, 8, 8)
    out["wrong_order"] = error_of(lambda: meshddp.DistributedDataParallel(Net(), mesh, ("cp", "dp")))
    out["unknown_dim"] = error_of(lambda: meshddp.DistributedDataParallel(Net(), mesh, ("dp", "sp")))
    out["not_names"] = error_of(lambda: meshddp.DistributedDataParallel(Net(), mesh, ("dp", 1)))

    mesh3 = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    torch.manual_seed(0)
    block = Block()
    golden = copy.deepcopy(block)
    parallelize_module(block, mesh3["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    out["cp_x_tp"] = train_vs_single(mesh3, block, golden, "sgd", 16, 8)
    return out


def multi_dim_on_one_gpu(rank, world_size):
    """A dp 1 x cp 1 x tp 1 mesh on this rank's GPU (NCCL): the flattened DP x CP group and the TP group
    made on NCCL, every bucket collective forced (MESHDDP_FORCE_COLLECTIVES=1 in the environment); the
    MLP with torch SGD and with meshddp ZeRO-1 (the fused CUDA AdamW) against one process on the GPU."""
    mesh = init_device_mesh("cuda", (1, 1, 1), mesh_dim_names=("dp", "cp", "tp"))
    out = {}
    for optimizer in ("sgd", "zero1"):
        torch.manual_seed(0)
        model = Net().cuda()
        out[optimizer] = train_vs_single(mesh, model, copy.deepcopy(model), optimizer, 8, 8)
    return out
