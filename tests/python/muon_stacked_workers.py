"""Workers for test_muon_stacked.py: Muon on stacked matrices (OptimizerConfig.muon_stacked_matrices)
on the MoE of moe_vs_cpp_workers.py, whose experts are two 3-D params w1 [E, d, h] and w2 [E, h, d]
(plain params, or torchtitan-style DTensors Shard(0) over mesh["ep"]). The golden: the same model in
one process with every expert matrix a separate 2-D param (the HF-style Moe: "experts.<i>.w1"), on
the global batch, stepped by torch.optim.Muon (bf16 iteration) or by the same ops in fp32
(muon_workers.reference_muon_step), with torch.optim.AdamW on the rest."""

import io
import warnings

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import meshddp
from moe_vs_cpp_workers import D, EXPERTS, STEPS, Moe, write_inputs
from muon_workers import reference_muon_step

LR, WD = 0.02, 0.01
GLOBAL_ROWS = 16  # the global batch of every step: the same rows at every DP size


def inputs():
    """Initial values and the STEPS global batches (moe_vs_cpp_workers.write_inputs, GLOBAL_ROWS rows)."""
    buffer = io.BytesIO()
    write_inputs(buffer, GLOBAL_ROWS // 4)  # 4 ranks of 4 rows
    buffer.seek(0)
    return torch.load(buffer)


def local_batch(init, step, rank, world_size, ep):
    """This rank's rows, its EP group's rows (what the all-to-all would bring to its experts) and the
    loss scale (the mean over the ranks is the one-process loss)."""
    x, y = init[f"x{step}"], init[f"y{step}"]
    rows = GLOBAL_ROWS // world_size
    group = rank // ep * ep * rows
    return (x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows], x[group:group + ep * rows],
            y[group:group + ep * rows], 1.0 / (rows * D))


def build(world_size, ep, stacked, ns_dtype="fp32", device="cpu"):
    """The MoE over a DP mesh (ep 1: w1, w2 plain 3-D params) or an ("edp", "ep") mesh (ep > 1: 3-D
    DTensor experts), ZeRO-1 whole_param, kind muon. device "cuda" (ep 1): the model on this rank's GPU."""
    init = inputs()
    if ep == 1:
        mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("dp",))
        model = Moe(init, None, hf_style=False).to(device)
        ddp = meshddp.DistributedDataParallel(model, mesh, config=meshddp.DdpConfig(
            bucket_bytes=512, use_distributed_optimizer=True, shard_policy="whole_param"))
    else:
        mesh = init_device_mesh("cpu", (world_size // ep, ep), mesh_dim_names=("edp", "ep"))
        model = Moe(init, mesh["ep"], hf_style=False)
        ddp = meshddp.DistributedDataParallel(model, mesh, dp_dim=("edp", "ep"), config=meshddp.DdpConfig(
            bucket_bytes=512, use_distributed_optimizer=True, shard_policy="whole_param", expert_parallel_size=ep))
    opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(
        kind="muon", lr=LR, weight_decay=WD, muon_ns_dtype=ns_dtype, muon_stacked_matrices=stacked))
    return init, model, ddp, opt


def train(init, model, ddp, opt, rank, world_size, ep, first, last, device="cpu"):
    for step in range(first, last):
        ddp.zero_grad_buffer()
        x, y, xg, yg, scale = local_batch(init, step, rank, world_size, ep)
        ddp(x.to(device), y.to(device), xg.to(device), yg.to(device), scale).backward()
        opt.step()
    opt.finish_param_sync()


def local(p):
    return (p.to_local() if isinstance(p, DTensor) else p).detach().clone()


def golden(init, stacked, ns_dtype, device="cpu"):
    """STEPS steps in one process: every expert matrix a 2-D param; with `stacked`, they, the router
    and the head's weight on Muon (torch.optim.Muon for bf16, reference_muon_step for fp32), else the
    experts on AdamW. Returns {name: value}, experts stacked back into "w1" and "w2"."""
    model = Moe(init, None, hf_style=True).to(device)
    named = dict(model.named_parameters())
    muon_names = [n for n, p in named.items() if p.dim() == 2 and (stacked or not n.startswith("experts."))]
    matrices = [named[n] for n in muon_names]
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in muon_names], lr=LR, weight_decay=WD,
                              foreach=False)
    muon = torch.optim.Muon(matrices, lr=LR, weight_decay=WD, momentum=0.95, nesterov=True,
                            adjust_lr_fn="original") if ns_dtype == "bf16" else None
    bufs = [torch.zeros_like(p) for p in matrices]
    for step in range(STEPS):
        x, y = init[f"x{step}"].to(device), init[f"y{step}"].to(device)
        for p in named.values():
            p.grad = None
        model(x, y, x, y, 1.0 / (GLOBAL_ROWS * D)).backward()
        adamw.step()
        with torch.no_grad():
            if muon is not None:
                muon.step()
            else:
                reference_muon_step(matrices, bufs, lr=LR, wd=WD, momentum=0.95, nesterov=True, coefficients="torch",
                                    steps=5, dtype=torch.float32, scale="original", extra=1.0)
    out = {n: p.detach() for n, p in named.items() if not n.startswith("experts.")}
    for w in ("w1", "w2"):
        out[w] = torch.stack([named[f"experts.{i}.{w}"].detach() for i in range(EXPERTS)])
    return out


def stacked_vs_one_process(rank, world_size, ep=1, stacked=True, ns_dtype="fp32", device="cpu"):
    """STEPS steps at dp = world_size (EP ep) against golden(): the largest difference of the experts,
    of the other Muon matrices (router, head) and of the AdamW params (norm, head bias), how far the
    experts moved, the optimizer's muon_params and the state kinds of w1 in its state_dict()."""
    init, model, ddp, opt = build(world_size, ep, stacked, ns_dtype, device)
    train(init, model, ddp, opt, rank, world_size, ep, 0, STEPS, device)
    want = golden(init, stacked, ns_dtype, device)
    first = 0 if ep == 1 else ddp.module.w1.device_mesh.get_local_rank() * (EXPERTS // ep)
    diff, moved = {}, []
    for n, p in ddp.module.named_parameters():
        expected = want[n].narrow(0, first, EXPERTS // ep) if n in ("w1", "w2") else want[n]
        diff[n] = (local(p) - expected).abs().max().item()
        if n in ("w1", "w2"):
            initial = init[n].narrow(0, first, EXPERTS // ep).to(device)
            moved.append((expected - initial).abs().max().item())
    state = opt.state_dict()["state"] if ep == 1 else {}  # (DCP's layout does not describe EP > 1 yet)
    return {"expert_diff": max(diff["w1"], diff["w2"]), "matrix_diff": max(diff["router.weight"], diff["head.weight"]),
            "adamw_diff": max(diff[n] for n in ("norm.weight", "norm.bias", "head.bias")), "moved": min(moved),
            "muon_params": opt.muon_params, "w1_state": sorted(state["w1"].keys()) if "w1" in state else None}


def stacked_resumable(rank, world_size, first, last, save_dir=None, load_dir=None, stacked=True):
    """Steps [first, last) with muon_stacked_matrices (fp32 iteration) at dp = world_size: from a fresh
    model, or from load_dir's checkpoint; saves into save_dir at the end. Returns the params, or the
    load's error message."""
    init, model, ddp, opt = build(world_size, 1, stacked)
    if load_dir is not None:
        try:
            opt.load_checkpoint(load_dir)
        except RuntimeError as e:
            return str(e)
        assert opt.steps_taken == first, opt.steps_taken
    train(init, model, ddp, opt, rank, world_size, 1, first, last)
    if save_dir is not None:
        opt.save_checkpoint(save_dir)
    return {n: local(p) for n, p in ddp.module.named_parameters()}


class TpStack(torch.nn.Module):
    def __init__(self, tp_mesh, dim):
        super().__init__()
        self.w = torch.nn.Parameter(distribute_tensor(torch.randn(2, 4, 4), tp_mesh, [Shard(dim)]))

    def forward(self, x):
        return torch.einsum("td,edh->teh", x, self.w.to_local()).sum()


def tp_sharded_stack_refused(rank, world_size, dim):
    """A 3-D param sharded over TP on `dim` (dp 1 x tp world_size): the error of a muon_stacked_matrices
    optimizer, or None."""
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    ddp = meshddp.DistributedDataParallel(TpStack(mesh["tp"], dim), mesh, config=meshddp.DdpConfig(
        use_distributed_optimizer=True, shard_policy="whole_param"))
    try:
        meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="muon", muon_stacked_matrices=True))
    except RuntimeError as e:
        return str(e)
    return None


def settings_differ(rank, world_size):
    """Rank 1 alone sets muon_stacked_matrices: each rank's error, or None."""
    try:
        build(world_size, 1, stacked=rank == 1)
    except RuntimeError as e:
        return str(e)
    return None


class ConvAndStack(torch.nn.Module):
    """A Conv1d kernel [6, 4, 3] (3-D, not a stack of matrices) beside a stack of experts [2, 4, 6]."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(4, 6, 3)
        self.experts = torch.nn.Parameter(torch.randn(2, 4, 6))

    def forward(self, x):
        return self.conv(x).sum() + torch.einsum("bcl,ecn->ben", x, self.experts).sum()


def conv_kernel_warnings(rank, world_size, muon_adamw_params):
    """The warnings of a muon_stacked_matrices optimizer over ConvAndStack, and its Muon params."""
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    ddp = meshddp.DistributedDataParallel(ConvAndStack(), mesh, config=meshddp.DdpConfig(
        use_distributed_optimizer=True, shard_policy="whole_param"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(
            kind="muon", muon_stacked_matrices=True, muon_adamw_params=muon_adamw_params))
    return {"muon": opt.muon_params, "warnings": [str(w.message) for w in caught]}


class EmptyStack(torch.nn.Module):
    """A stack of no experts [0, 4, 6] (an empty param) beside a stack of two."""

    def __init__(self, with_empty):
        super().__init__()
        torch.manual_seed(0)
        self.experts = torch.nn.Parameter(torch.randn(2, 4, 6))
        self.empty = torch.nn.Parameter(torch.zeros(0, 4, 6)) if with_empty else None

    def forward(self, x):
        out = torch.einsum("bc,ecn->ben", x, self.experts).square().sum()
        return out if self.empty is None else out + self.empty.sum()


def steps_beside_an_empty_stack(rank, world_size, kind, with_empty):
    """Two steps of EmptyStack (an empty param in the param buffer, or none): the experts after them."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    model = EmptyStack(with_empty)
    ddp = meshddp.DistributedDataParallel(model, mesh, config=meshddp.DdpConfig(
        use_distributed_optimizer=True, shard_policy="whole_param"))
    extra = {"muon_stacked_matrices": True} if kind == "muon" else {}
    opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind=kind, lr=LR, **extra))
    for step in range(2):
        ddp(torch.full((3, 4), 0.1 * (rank + step + 1))).backward()
        opt.step()
        opt.zero_grad()
    return model.experts.detach().clone()


def state_dict_loaded_with_the_setting_flipped(rank, world_size, saved_stacked):
    """A state_dict() saved with muon_stacked_matrices = saved_stacked, loaded (load_state_dict) into an
    optimizer with the other setting: the error."""
    _, _, _, saved = build(world_size, 1, stacked=saved_stacked)
    state = saved.state_dict()
    _, _, _, other = build(world_size, 1, stacked=not saved_stacked)
    try:
        other.load_state_dict(state)
    except RuntimeError as e:
        return str(e)
    return None
