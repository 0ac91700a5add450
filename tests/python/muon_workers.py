"""Workers for test_muon.py: meshddp.DistributedOptimizer(kind="muon") on DP ranks against
torch.optim.Muon + torch.optim.AdamW (or the same math in fp32, for the settings torch does not have)
in one process on the global batch; every rank computes the golden itself."""

import copy
import math

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import meshddp

STEPS = 5
LR, ADAMW_LR, WD = 0.02, 0.003, 0.01
# The AdamW params and their LR: the defaults of muon_adamw_params ("*embed*,*lm_head*") keep the
# 2-D embed and lm_head on AdamW; every vector is on AdamW anyway.
ADAMW_GROUPS = [("*embed*", ADAMW_LR, None), ("*lm_head*", ADAMW_LR, None), ("*bias", ADAMW_LR, None),
                ("*norm*", ADAMW_LR, None)]


class MuonNet(torch.nn.Module):
    """Matrices tall (fc1: 64 x 32), wide (fc2: 48 x 64) and square (fc3), vectors, and two 2-D
    params kept on AdamW by name (embed, lm_head)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 32)
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 48)
        self.fc3 = torch.nn.Linear(48, 48, bias=False)
        self.norm = torch.nn.LayerNorm(48)
        self.lm_head = torch.nn.Linear(48, 4)

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        h = torch.tanh(self.fc1(h))
        h = torch.tanh(self.fc2(h))
        return self.lm_head(self.norm(self.fc3(h)))


def muon_names(model):
    return [n for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n and "lm_head" not in n]


def global_batch(step, world_size):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4 * world_size, 8, generator=g), torch.randn(4 * world_size, 4, generator=g)


# The fp32 golden for settings torch.optim.Muon does not offer: torch's ops (torch/optim/_muon.py)
# with the iteration dtype, coefficients and scale rule as parameters.
QUINTIC = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]


def reference_muon_step(params, bufs, *, lr, wd, momentum, nesterov, coefficients, steps, dtype, scale, extra):
    for p, buf in zip(params, bufs):
        g = p.grad
        buf.lerp_(g, 1 - momentum)
        u = g.lerp(buf, momentum) if nesterov else buf
        x = u.to(dtype)
        if u.size(0) > u.size(1):
            x = x.T
        x = x / x.norm().clamp(min=1e-7)
        for i in range(steps):
            a, b, c = (3.4445, -4.7750, 2.0315) if coefficients == "torch" else QUINTIC[min(i, 4)]
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        if u.size(0) > u.size(1):
            x = x.T
        m, n = p.shape
        ratio = {"original": math.sqrt(max(1, m / n)), "match_rms_adamw": 0.2 * math.sqrt(max(m, n)),
                 "spectral": math.sqrt(max(m, n)) * extra}[scale]
        p.mul_(1 - lr * wd)
        p.add_(x, alpha=-lr * ratio)


def muon_vs_one_process(rank, world_size, golden="torch", ns_dtype="bf16", coefficients="torch", scale="original",
                        nesterov=True, extra=1.0, clip=0.0, tp=1, device="cpu"):
    """With tp 2: fc1 column-parallel and fc2 row-parallel (torch's DTensor TP), each orthogonalized
    whole (gathered over TP). device "cuda": the model, the golden and the mesh on this rank's GPU."""
    torch.manual_seed(0)
    model = MuonNet().to(device)
    ref = copy.deepcopy(model)
    dp = world_size // tp
    mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    me = mesh.get_local_rank("dp")
    ddp = meshddp.DistributedDataParallel(model, mesh, config=meshddp.DdpConfig(
        bucket_bytes=8192, use_distributed_optimizer=True, shard_policy="whole_param"))
    opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(
        kind="muon", lr=LR, weight_decay=WD, groups=ADAMW_GROUPS, muon_ns_dtype=ns_dtype, clip_grad_norm=clip,
        muon_ns_coefficients=coefficients, muon_scale=scale, muon_nesterov=nesterov, muon_extra_scale=extra))
    matrices = [p for n, p in ref.named_parameters() if n in muon_names(ref)]
    others = [p for n, p in ref.named_parameters() if n not in muon_names(ref)]
    adamw = torch.optim.AdamW(others, lr=ADAMW_LR, weight_decay=WD, foreach=False)
    if golden == "torch":
        muon = torch.optim.Muon(matrices, lr=LR, weight_decay=WD, momentum=0.95, nesterov=nesterov,
                                adjust_lr_fn=scale)
    bufs = [torch.zeros_like(p) for p in matrices]
    norms, golden_norms = [], []
    for step in range(STEPS):
        x, y = (t.to(device) for t in global_batch(step, dp))
        ddp.zero_grad_buffer()
        F.mse_loss(ddp(x.chunk(dp)[me]), y.chunk(dp)[me]).backward()
        norms.append(opt.step().grad_norm)
        adamw.zero_grad()
        for p in matrices:
            p.grad = None
        F.mse_loss(ref(x), y).backward()
        golden_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip if clip > 0 else float("inf")).item())
        adamw.step()
        with torch.no_grad():
            if golden == "torch":
                muon.step()
            else:
                reference_muon_step(matrices, bufs, lr=LR, wd=WD, momentum=0.95, nesterov=nesterov,
                                    coefficients=coefficients, steps=5,
                                    dtype=torch.bfloat16 if ns_dtype == "bf16" else torch.float32, scale=scale,
                                    extra=extra)
    opt.finish_param_sync()
    got, want = dict(ddp.module.named_parameters()), dict(ref.named_parameters())
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in got.items()}
    names = muon_names(ref)
    diff = {n: (full[n] - want[n].detach()).abs().max().item() for n in want}
    moved = {n: (want[n].detach() - dict(MuonNet().to(device).named_parameters())[n]).abs().max().item() for n in names}
    return {"muon_diff": max(diff[n] for n in names), "adamw_diff": max(diff[n] for n in want if n not in names),
            "norm_diff": max(abs(a - b) for a, b in zip(norms, golden_norms)), "moved": min(moved.values()),
            "dtensors": sorted(n for n, p in got.items() if isinstance(p, DTensor))}


def train(world_size, rank, shard_policy, kind, overlap, steps=STEPS, strategy="optim"):
    """This rank's whole params (ddp.state_dict(): whole under every strategy) after `steps` steps."""
    torch.manual_seed(0)
    model = MuonNet()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    ddp = meshddp.DistributedDataParallel(model, mesh, config=meshddp.DdpConfig(
        bucket_bytes=8192, data_parallel_sharding_strategy=strategy, shard_policy=shard_policy))
    opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(
        kind=kind, lr=LR, weight_decay=WD, groups=ADAMW_GROUPS, overlap_param_gather=overlap))
    for step in range(steps):
        x, y = global_batch(step, world_size)
        ddp.zero_grad_buffer()
        F.mse_loss(ddp(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
        opt.step()
    opt.finish_param_sync()
    return [v.detach().clone() for v in ddp.state_dict().values()]


def policies_and_overlap(rank, world_size):
    """AdamW under whole_param against byte_range ZeRO-1; Muon with the overlapped param gather
    against the blocking one."""
    adamw_whole = train(world_size, rank, "whole_param", "adamw", False)
    adamw_bytes = train(world_size, rank, "byte_range", "adamw", False)
    muon_blocking = train(world_size, rank, "whole_param", "muon", False)
    muon_overlap = train(world_size, rank, "whole_param", "muon", True)
    return {"adamw_policy_diff": max((a - b).abs().max().item() for a, b in zip(adamw_whole, adamw_bytes)),
            "overlap_identical": all(torch.equal(a, b) for a, b in zip(muon_blocking, muon_overlap))}


def muon_needs_whole_param(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    ddp = meshddp.DistributedDataParallel(MuonNet(), mesh, config=meshddp.DdpConfig(use_distributed_optimizer=True))
    try:
        meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="muon"))
    except RuntimeError as e:
        return str(e)
    return None


def muon_resumable(rank, world_size, first, last, save_dir=None, load_dir=None):
    """Muon (fp32 iteration) on the fixed global batch of 16 rows for steps [first, last): from a
    fresh model, or from load_dir's checkpoint (saved at any DP size); saves into save_dir at the end."""
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    ddp = meshddp.DistributedDataParallel(MuonNet(), mesh, config=meshddp.DdpConfig(
        bucket_bytes=8192, use_distributed_optimizer=True, shard_policy="whole_param"))
    opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(
        kind="muon", lr=LR, weight_decay=WD, groups=ADAMW_GROUPS, muon_ns_dtype="fp32"))
    if load_dir is not None:
        opt.load_checkpoint(load_dir)
        assert opt.steps_taken == first, opt.steps_taken
    for step in range(first, last):
        x, y = global_batch(step, 4)
        ddp.zero_grad_buffer()
        F.mse_loss(ddp(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
        opt.step()
    opt.finish_param_sync()
    if save_dir is not None:
        opt.save_checkpoint(save_dir)
    return [p.detach().clone() for p in ddp.module.parameters()]


def muon_under_each_sharding_strategy(rank, world_size):
    """Muon on whole_param shards under optim, optim_grads and optim_grads_params (each rank's shard holds
    whole matrices under all three): the largest difference of each run's params after STEPS steps from the
    optim run's."""
    optim = train(world_size, rank, "whole_param", "muon", False)
    return {s: max((a - b).abs().max().item()
                   for a, b in zip(train(world_size, rank, "whole_param", "muon", False, strategy=s), optim))
            for s in ("optim_grads", "optim_grads_params")}
