"""Per-rank bodies of test_torch_surface.py: what a Megatron or torch trainer expects of the Python
package (param groups driven by LR schedulers, clip_grad_norm_ on a torch-TP model, param.main_grad,
expert params and optimizer instances), each against one process on the global batch."""

import math

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import meshddp

ROWS = 4  # per rank
STEPS = 6
GROUPS = [("*.bias", None, 0.0), ("norm.*", 5e-3, 0.0)]  # no decay on biases and norms; half the LR on norms


class Block(torch.nn.Module):
    def __init__(self, d=8):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(d, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.fc2 = torch.nn.Linear(16, d)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def data(step, rows, d=8):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, d, generator=g), torch.randn(rows, d, generator=g)


def golden_groups(model, lr, weight_decay):
    """torch AdamW's groups for GROUPS: default, then '*.bias', then 'norm.*' (first match wins)."""
    named = dict(model.named_parameters())
    bias = [n for n in named if n.endswith(".bias")]
    norm = [n for n in named if n.startswith("norm.") and n not in bias]
    rest = [n for n in named if n not in bias and n not in norm]
    return [{"params": [named[n] for n in rest], "lr": lr, "weight_decay": weight_decay},
            {"params": [named[n] for n in bias], "lr": lr, "weight_decay": 0.0},
            {"params": [named[n] for n in norm], "lr": 5e-3, "weight_decay": 0.0}]


def make_schedule(kind, opt):
    if kind == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    if kind == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=1e-4)
    sched = meshddp.LrScheduler(meshddp.LrScheduleConfig(
        max_lr=1e-2, min_lr=1e-3, warmup_steps=2, decay_steps=STEPS, decay_style="cosine", start_wd=0.1, end_wd=0.3,
        wd_incr_steps=STEPS, wd_incr_style="linear"))
    sched.attach(opt)
    return sched


def schedules(rank, world_size, directory):
    """Each schedule drives ZeRO-1 over dp = world_size with GROUPS, STEPS steps, against torch AdamW
    with the same groups and schedule on the global batch; "lambda" also saves at step 3 with DCP
    (model, optimizer) and the scheduler's state_dict(), and resumes into fresh objects."""
    out = {}
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    for kind in ("lambda", "cosine", "meshddp"):
        golden = Block()
        gopt = torch.optim.AdamW(golden_groups(golden, 1e-2, 0.1), lr=1e-2, weight_decay=0.1)
        gsched = make_schedule(kind, gopt)

        def build():
            ddp = meshddp.DistributedDataParallel(Block(), mesh, config=meshddp.DdpConfig(use_distributed_optimizer=True))
            opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(lr=1e-2, weight_decay=0.1, groups=GROUPS))
            return ddp, opt, make_schedule(kind, opt)

        ddp, opt, sched = build()
        out[kind] = {"names": [g["param_names"] for g in opt.param_groups], "lrs": [], "golden_lrs": []}
        for step in range(STEPS):
            if kind == "lambda" and step == 3:  # resume from DCP into fresh objects
                dcp.save({"model": ddp.state_dict(), "optim": opt.state_dict()}, checkpoint_id=directory)
                sched_state = sched.state_dict()
                ddp, opt, sched = build()
                state = {"model": ddp.state_dict(), "optim": opt.state_dict()}
                dcp.load(state, checkpoint_id=directory)
                ddp.load_state_dict(state["model"])
                opt.load_state_dict(state["optim"])
                sched.load_state_dict(sched_state)
            x, y = data(step, ROWS * world_size)
            out[kind]["lrs"].append([(g["lr"], g["weight_decay"]) for g in opt.param_groups])
            out[kind]["golden_lrs"].append([(g["lr"], g["weight_decay"]) for g in gopt.param_groups])
            ddp.zero_grad_buffer()
            F.mse_loss(ddp(x[rank * ROWS:(rank + 1) * ROWS]), y[rank * ROWS:(rank + 1) * ROWS]).backward()
            opt.step()
            sched.step()
            gopt.zero_grad()
            F.mse_loss(golden(x), y).backward()
            gopt.step()
            gsched.step()
        opt.finish_param_sync()
        gparams = dict(golden.named_parameters())
        out[kind]["param_diff"] = max((p - gparams[n]).abs().max().item() for n, p in ddp.named_parameters())
        out[kind]["sched_state"] = type(sched).__name__
    return out


class TpNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 8)
        self.head = torch.nn.Linear(8, 4)  # stays a plain param: the mix torch's clip_grad_norm_ fails on

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def clip_tp(rank, world_size, dp, tp):
    """meshddp.clip_grad_norm_ on a torch-TP model (fc1 colwise, fc2 rowwise, a plain head) over
    dp x tp, and param.main_grad after finish_grad_sync(), against torch's clip_grad_norm_ on the
    same model in one process on the global batch; then torch's own clip on the mixed params."""
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    golden, model = TpNet(), TpNet()
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    ddp = meshddp.DistributedDataParallel(model, mesh, config=meshddp.DdpConfig(bucket_bytes=256))
    x, y = data(0, ROWS * dp, 8)
    y = y[:, :4]
    me = mesh.get_local_rank("dp")
    ddp.zero_grad_buffer()
    (ddp(x[me * ROWS:(me + 1) * ROWS]) - y[me * ROWS:(me + 1) * ROWS]).pow(2).mean().backward()
    F.mse_loss(golden(x), y, reduction="mean").backward()
    ddp.finish_grad_sync()
    named, gnamed = dict(ddp.named_parameters()), dict(golden.named_parameters())
    out = {"main_grad_diff": max((full(p.main_grad) - gnamed[n].grad).abs().max().item() for n, p in named.items()),
           "main_grad_is_grad": all(p.main_grad.data_ptr() == p.grad.data_ptr() if not isinstance(p, DTensor)
                                    else p.main_grad is p.grad for p in named.values())}
    max_norm = 0.05
    want = torch.nn.utils.clip_grad_norm_(golden.parameters(), max_norm).item()
    got = meshddp.clip_grad_norm_(ddp, max_norm).item()
    out.update(norm=got, golden_norm=want,
               grad_diff=max((full(p.grad) - gnamed[n].grad).abs().max().item() for n, p in named.items()),
               clipped_norm=math.sqrt(sum(full(p.grad).pow(2).sum().item() for p in named.values())))
    try:
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm)
        out["torch_clip_error"] = None
    except Exception as e:  # noqa: BLE001 (what torch says on the mix of DTensor and plain params)
        out["torch_clip_error"] = f"{type(e).__name__}: {e}"
    return out


class Moe(torch.nn.Module):
    """A norm, a router and E experts as two 3-D params (torchtitan's GroupedExperts: w1 [E, d, h],
    w2 [E, h, d]), every token to every expert weighted by its gate (a dense MoE, so that the
    arithmetic is independent of the routing), then a head. With `ep_mesh`, w1 and w2 are DTensors
    sharded on dim 0 over it: each EP rank runs its experts on all EP ranks' tokens (gathered by an
    autograd all-reduce) and the outputs are summed back to each token's rank the same way."""

    def __init__(self, d=8, h=12, experts=4, ep_mesh=None, hf_style=False):
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(d)
        self.router = torch.nn.Linear(d, experts, bias=False)
        self.w1 = torch.nn.Parameter(torch.randn(experts, d, h) * 0.3)
        self.w2 = torch.nn.Parameter(torch.randn(experts, h, d) * 0.3)
        self.head = torch.nn.Linear(d, d)
        self.ep_mesh = ep_mesh
        self.experts = None
        if hf_style:  # HF-style: one module per expert, under its global index, each EP rank keeping its own
            n, r = (1, 0) if ep_mesh is None else (ep_mesh.size(), ep_mesh.get_local_rank())
            mine = range(r * experts // n, (r + 1) * experts // n)
            self.experts = torch.nn.ModuleDict({str(e): torch.nn.ParameterDict(
                {"w1": torch.nn.Parameter(self.w1.data[e].clone()), "w2": torch.nn.Parameter(self.w2.data[e].clone())})
                for e in mine})
            del self.w1, self.w2
        elif ep_mesh is not None:
            self.w1 = torch.nn.Parameter(distribute_tensor(self.w1.data, ep_mesh, [Shard(0)]))
            self.w2 = torch.nn.Parameter(distribute_tensor(self.w2.data, ep_mesh, [Shard(0)]))

    def forward(self, x):
        z = self.norm(x)
        gates = torch.softmax(self.router(z), -1)
        if self.experts is not None:
            w1, w2 = (torch.stack([e[k] for e in self.experts.values()]) for k in ("w1", "w2"))
        else:
            w1, w2 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2))
        n, r = (1, 0) if self.ep_mesh is None else (self.ep_mesh.size(), self.ep_mesh.get_local_rank())
        if n > 1:  # every EP rank's tokens, in EP rank order
            group = self.ep_mesh.get_group()
            z, gates = (dist_fn.all_reduce(torch.cat([t if i == r else torch.zeros_like(t) for i in range(n)]),
                                           group=group) for t in (z, gates))
        first = r * w1.shape[0]
        hidden = torch.relu(torch.einsum("td,edh->teh", z, w1))
        part = torch.einsum("ted,te->td", torch.einsum("teh,ehd->ted", hidden, w2), gates[:, first:first + w1.shape[0]])
        if n > 1:  # the sum over all experts, back to each token's rank
            part = dist_fn.all_reduce(part, group=self.ep_mesh.get_group()).chunk(n)[r]
        return self.head(x + part)


def local_golden(name, p, golden, ep, e):
    """The one-process value matching DDP param `name`: its EP chunk for an expert DTensor, and for an
    HF-style expert 'experts.<i>.w1' the golden w1[i] (`golden` is the one-process model's tensors by name)."""
    if name.startswith("experts."):
        _, i, kind = name.split(".")
        return golden[kind].detach()[int(i)]
    want = golden[name].detach()
    return want.chunk(ep)[e] if isinstance(p, DTensor) else want


def moe(rank, world_size, ep, zero1, hf_style=False, instances=1):
    """A torchtitan-style MoE on world_size ranks (a ("edp", "ep") mesh, experts sharded over "ep",
    DDP over both dims flattened), STEPS AdamW steps (meshddp's ZeRO-1, or torch's on plain DDP, which
    also compares param.main_grad after the first backward), against one process on the global batch.
    `instances`: num_distributed_optimizer_instances (ZeRO-1)."""
    mesh = init_device_mesh("cpu", (world_size // ep, ep), mesh_dim_names=("edp", "ep"))
    model = Moe(ep_mesh=mesh["ep"], hf_style=hf_style)
    config = meshddp.DdpConfig(use_distributed_optimizer=zero1, expert_parallel_size=ep, bucket_bytes=512,
                               num_distributed_optimizer_instances=instances)
    ddp = meshddp.DistributedDataParallel(model, mesh, dp_dim=("edp", "ep"), config=config,
                                          expert_params=["experts.*"] if hf_style else ())
    if zero1:
        opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(lr=1e-2, weight_decay=0.1, groups=GROUPS[:1]))
    else:
        named = dict(ddp.named_parameters())
        opt = torch.optim.AdamW([{"params": [p for n, p in named.items() if not n.endswith(".bias")]},
                                 {"params": [p for n, p in named.items() if n.endswith(".bias")], "weight_decay": 0.0}],
                                lr=1e-2, weight_decay=0.1)
    golden = Moe()
    e = mesh.get_local_rank("ep")
    grad_diffs = {}
    named = dict(golden.named_parameters())
    gopt = torch.optim.AdamW([{"params": [p for n, p in named.items() if not n.endswith(".bias")]},
                              {"params": [p for n, p in named.items() if n.endswith(".bias")], "weight_decay": 0.0}],
                             lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        x, y = data(step, ROWS * world_size)
        ddp.zero_grad_buffer()
        loss = F.mse_loss(ddp(x[rank * ROWS:(rank + 1) * ROWS]), y[rank * ROWS:(rank + 1) * ROWS])
        loss.backward()
        gopt.zero_grad()
        golden_loss = F.mse_loss(golden(x), y)
        golden_loss.backward()
        if not zero1:
            ddp.finish_grad_sync()  # the ZeRO-1 step() does it itself
        if step == 0 and not zero1:
            ggrads = {n: q.grad for n, q in golden.named_parameters()}
            for name, p in ddp.named_parameters():
                got = p.main_grad.to_local() if isinstance(p, DTensor) else p.main_grad
                grad_diffs[name] = (got - local_golden(name, p, ggrads, ep, e)).abs().max().item()
        opt.step()
        gopt.step()
        losses.append((loss.item(), golden_loss.item()))
    state_dict_error = None
    if zero1:
        opt.finish_param_sync()
        try:
            opt.state_dict()
        except RuntimeError as err:
            state_dict_error = str(err)
    gnamed = dict(golden.named_parameters())
    diffs = {}
    for name, p in ddp.named_parameters():
        diffs[name] = ((p.to_local() if isinstance(p, DTensor) else p.detach()) -
                       local_golden(name, p, gnamed, ep, e)).abs().max().item()
    return {"diffs": diffs, "grad_diffs": grad_diffs, "engine_names": ddp._engine.param_names(), "losses": losses,
            "state_dict_error": state_dict_error, "sharding": ddp._engine._bucket_sharding()}


def instances_refused_by_expert_dp(rank, world_size, k):
    """The error each rank gets for K optimizer instances that do not divide the expert-DP size."""
    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("edp", "ep"))
    config = meshddp.DdpConfig(use_distributed_optimizer=True, expert_parallel_size=2,
                               num_distributed_optimizer_instances=k)
    try:
        meshddp.DistributedDataParallel(Moe(hf_style=True), mesh, dp_dim=("edp", "ep"), config=config,
                                        expert_params=["experts.*"])
    except RuntimeError as err:
        return str(err)
    return None


def instances(rank, world_size, k):
    """Hierarchical ZeRO-1 (num_distributed_optimizer_instances = k) over dp = world_size, STEPS
    AdamW steps with GROUPS, against torch AdamW on the global batch."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    config = meshddp.DdpConfig(use_distributed_optimizer=True, num_distributed_optimizer_instances=k, bucket_bytes=256)
    ddp = meshddp.DistributedDataParallel(Block(), mesh, config=config)
    opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(lr=1e-2, weight_decay=0.1, groups=GROUPS))
    golden = Block()
    gopt = torch.optim.AdamW(golden_groups(golden, 1e-2, 0.1), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        x, y = data(step, ROWS * world_size)
        ddp.zero_grad_buffer()
        F.mse_loss(ddp(x[rank * ROWS:(rank + 1) * ROWS]), y[rank * ROWS:(rank + 1) * ROWS]).backward()
        opt.step()
        gopt.zero_grad()
        F.mse_loss(golden(x), y).backward()
        gopt.step()
    opt.finish_param_sync()
    gnamed = dict(golden.named_parameters())
    return {"param_diff": max((p - gnamed[n]).abs().max().item() for n, p in ddp.named_parameters()),
            "optimizer_state_bytes": opt.memory()["optimizer_state_bytes"]}


def suite(rank, world_size, directory):
    return {"schedules": schedules(rank, world_size, directory), "clip": clip_tp(rank, world_size, 2, 2),
            "moe": moe(rank, world_size, 2, zero1=True), "moe_ddp": moe(rank, world_size, 2, zero1=False),
            "moe_hf": moe(rank, world_size, 2, zero1=False, hf_style=True),
            "instances": instances(rank, world_size, 2),
            "moe_instances": moe(rank, world_size, 2, zero1=True, hf_style=True, instances=2),
            "moe_instances_ep1": moe(rank, world_size, 1, zero1=True, hf_style=True, instances=2),
            "moe_instances_refused": instances_refused_by_expert_dp(rank, world_size, 4)}


def group_values_differ(rank, world_size, case):
    """At step(), rank 1's param_groups hold another value than rank 0's: set by hand ("lr"), by an LR
    scheduler with a rank-dependent factor ("scheduler"), or a value that only rank 1's validation would
    reject ("invalid_on_one_rank"). Returns each rank's error and whether any param changed."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    ddp = meshddp.DistributedDataParallel(Block(), mesh, config=meshddp.DdpConfig(use_distributed_optimizer=True))
    opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="sgd", lr=0.1, groups=GROUPS))
    before = [p.detach().clone() for p in ddp.parameters()]
    if case == "scheduler":
        torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1.0 if rank == 0 else 0.5)
    elif rank == 1:
        opt.param_groups[0 if case == "lr" else 2]["lr" if case == "lr" else "weight_decay"] = (
            0.05 if case == "lr" else -1.0)
    ddp.zero_grad_buffer()
    x, y = data(0, ROWS)
    F.mse_loss(ddp(x), y).backward()
    try:
        opt.step()
        error = None
    except (RuntimeError, ValueError) as e:
        error = str(e)
    return {"error": error, "changed": any(not p.equal(b) for p, b in zip(ddp.parameters(), before))}


def step_together_in_another_order(rank, world_size):
    """Two models' optimizers with different numbers of param groups, stepped together in another order on
    each rank (rank 1 swaps them). Returns each rank's error and whether any param changed."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    config = meshddp.DdpConfig(use_distributed_optimizer=True)
    ddps = [meshddp.DistributedDataParallel(Block(), mesh, config=config) for _ in range(2)]
    opts = [meshddp.DistributedOptimizer(ddps[0], meshddp.OptimizerConfig(kind="sgd", lr=0.1, groups=GROUPS)),
            meshddp.DistributedOptimizer(ddps[1], meshddp.OptimizerConfig(kind="sgd", lr=0.1))]
    before = [p.detach().clone() for ddp in ddps for p in ddp.parameters()]
    x, y = data(0, ROWS)
    for ddp in ddps:
        ddp.zero_grad_buffer()
        F.mse_loss(ddp(x), y).backward()
    try:
        meshddp.DistributedOptimizer.step_together(opts if rank == 0 else opts[::-1])
        error = None
    except (RuntimeError, ValueError) as e:
        error = str(e)
    after = [p for ddp in ddps for p in ddp.parameters()]
    return {"error": error, "changed": any(not p.equal(b) for p, b in zip(after, before))}
