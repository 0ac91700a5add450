"""The Python half of test_moe_python_vs_cpp.py: a small MoE trained by the Python package, step for
step as tests/python/moe_vs_cpp_worker.cpp trains it through the C++ API (same initial values and
batches, read from one file; same DdpConfig; same ops in the same order), so that the two runs of the
one engine can be compared param by param after every step.

The model: a LayerNorm, a router (no bias) and a head, and E experts (w1 [E, d, h], w2 [E, h, d]) of
which each EP rank holds E / EP. torchtitan-style: the layer's experts in one 3-D param, a DTensor
Shard(0) over mesh["ep"]; HF-style: one module per expert, named by its global index
("experts.<e>.w1"), declared with expert_params=["experts.*"]. A rank's loss (the C++ worker computes
the same): its own tokens through norm and head, plus every token of its EP group through each of its
experts (a dense MoE: no routing decisions), the squared error weighted by the token's gate; both
scaled by 1 / (local batch * d). The all-to-all of a real MoE is stood in for by the data: every rank
reads the whole batch, so no collective runs in forward and the two sides differ only in who drives
the engine. golden(): the same model in one process (every expert local) on the global batch."""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import meshddp

D, H, EXPERTS, ROWS, STEPS = 8, 12, 4, 4, 4  # ROWS: tokens per rank
LR, WEIGHT_DECAY, BUCKET_BYTES = 1e-2, 0.1, 512
CLIP = 1.2  # OptimizerConfig.clip_grad_norm: the steps' gradient norms are 1.44, 1.25, 1.28, 1.06


def write_inputs(path, world_size):
    """Initial values of the whole model (every expert) and the global batch of every step, to
    torch.save's file `path` (the C++ worker reads it with torch::pickle_load)."""
    g = torch.Generator().manual_seed(7)
    t = {"norm.weight": 1 + 0.1 * torch.randn(D, generator=g), "norm.bias": 0.1 * torch.randn(D, generator=g),
         "router.weight": 0.3 * torch.randn(EXPERTS, D, generator=g),
         "head.weight": 0.3 * torch.randn(D, D, generator=g), "head.bias": 0.1 * torch.randn(D, generator=g),
         "w1": 0.3 * torch.randn(EXPERTS, D, H, generator=g), "w2": 0.3 * torch.randn(EXPERTS, H, D, generator=g)}
    for step in range(STEPS):
        t[f"x{step}"] = torch.randn(ROWS * world_size, D, generator=g)
        t[f"y{step}"] = torch.randn(ROWS * world_size, D, generator=g)
    torch.save(t, path)


class Moe(torch.nn.Module):
    def __init__(self, init, ep_mesh, hf_style):
        """ep_mesh None: every expert, plain params (the one-process golden)."""
        super().__init__()
        ep, e = (1, 0) if ep_mesh is None else (ep_mesh.size(), ep_mesh.get_local_rank())
        self.local = EXPERTS // ep
        self.first = e * self.local
        self.norm = torch.nn.LayerNorm(D)
        self.router = torch.nn.Linear(D, EXPERTS, bias=False)
        self.head = torch.nn.Linear(D, D)
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(init[name])
        self.experts = None
        if hf_style:
            self.experts = torch.nn.ModuleDict({str(i): torch.nn.ParameterDict(
                {w: torch.nn.Parameter(init[w][i].clone()) for w in ("w1", "w2")})
                for i in range(self.first, self.first + self.local)})
        elif ep_mesh is None:
            self.w1, self.w2 = (torch.nn.Parameter(init[w].clone()) for w in ("w1", "w2"))
        else:
            self.w1 = torch.nn.Parameter(distribute_tensor(init["w1"], ep_mesh, [Shard(0)]))
            self.w2 = torch.nn.Parameter(distribute_tensor(init["w2"], ep_mesh, [Shard(0)]))

    def forward(self, x, y, xg, yg, scale):
        dense = (self.head(self.norm(x)) - y).pow(2).sum() * scale
        z = self.norm(xg)
        gates = torch.softmax(self.router(z), -1)
        if self.experts is not None:
            w1, w2 = (torch.stack([e[w] for e in self.experts.values()]) for w in ("w1", "w2"))
        else:
            w1, w2 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2))
        hidden = torch.relu(torch.einsum("td,edh->teh", z, w1))
        out = torch.einsum("teh,ehd->ted", hidden, w2)
        err = (out - yg.unsqueeze(1)).pow(2).sum(-1)
        return dense + (err * gates.narrow(1, self.first, self.local)).sum() * scale


def batch(inputs, step, rank, ep):
    """This rank's tokens and its EP group's (what the all-to-all would bring to its experts)."""
    x, y = inputs[f"x{step}"], inputs[f"y{step}"]
    group = rank // ep * ep * ROWS
    return (x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS], x[group:group + ep * ROWS],
            y[group:group + ep * ROWS], 1.0 / (ROWS * D))


def golden(inputs, world_size):
    """The same STEPS steps in one process on the global batch (every expert local, torch AdamW and
    clip_grad_norm_): the whole model's params after every step and the steps' gradient norms. The
    ranks' losses sum to this one's (dense terms over their own tokens, expert terms over each
    (token, expert) pair once, all over the global batch times d), given the engine's expert
    gradient scale (divided by the whole DP size)."""
    init = torch.load(inputs)
    model = Moe(init, None, hf_style=False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    params, norms = [], []
    for step in range(STEPS):
        x, y = init[f"x{step}"], init[f"y{step}"]
        opt.zero_grad()
        model(x, y, x, y, 1.0 / (ROWS * world_size * D)).backward()
        norms.append(sum(p.grad.double().pow(2).sum() for p in model.parameters()).sqrt().item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)  # max_norm / (norm + 1e-6), as meshddp
        opt.step()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"params": params, "grad_norms": norms}


def golden_of(name, golden, ep):
    """The one-process value of engine param `name`: 'w1@ep<e>of<EP>' is chunk e of w1,
    'experts.<i>.w1' is w1[i]."""
    if "@ep" in name:
        base, e = name.split("@ep")
        return golden[base].chunk(ep)[int(e.split("of")[0])]
    if name.startswith("experts."):
        _, i, w = name.split(".")
        return golden[w][int(i)]
    return golden[name]


def train(rank, world_size, inputs, style, ep, instances, comm_hook):
    """STEPS ZeRO-1 AdamW steps (gradients clipped to CLIP) at dp = world_size with EP `ep`,
    `instances` optimizer instances and DdpConfig.comm_hook `comm_hook`: the engine's params by
    engine name after every step, the engine's param order, each bucket's sharding, the losses and
    the steps' gradient norms."""
    mesh = init_device_mesh("cpu", (world_size // ep, ep), mesh_dim_names=("edp", "ep"))
    init = torch.load(inputs)
    model = Moe(init, mesh["ep"], hf_style=style == "hf")
    config = meshddp.DdpConfig(use_distributed_optimizer=True, expert_parallel_size=ep, bucket_bytes=BUCKET_BYTES,
                               num_distributed_optimizer_instances=instances, comm_hook=comm_hook)
    ddp = meshddp.DistributedDataParallel(model, mesh, dp_dim=("edp", "ep"), config=config,
                                          expert_params=["experts.*"] if style == "hf" else ())
    opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(lr=LR, weight_decay=WEIGHT_DECAY,
                                                                    clip_grad_norm=CLIP))
    params, losses, norms = [], [], []
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        loss = ddp(*batch(init, step, rank, ep))
        loss.backward()
        norms.append(opt.step().grad_norm)
        opt.finish_param_sync()
        losses.append(loss.item())
        params.append({ddp._engine_names.get(n, n): (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
                       for n, p in model.named_parameters()})
    return {"params": params, "losses": losses, "grad_norms": norms, "order": ddp._engine.param_names(),
            "sharding": ddp._engine._bucket_sharding()}


def nan_on_rank_2(rank, world_size, inputs):
    """The HF-style MoE at EP 2 in 2 optimizer instances with check_for_nan_in_grad: rank 2 (instance
    1) makes its first expert's gradient NaN. Each rank's error from step(), or None."""
    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("edp", "ep"))
    init = torch.load(inputs)
    model = Moe(init, mesh["ep"], hf_style=True)
    config = meshddp.DdpConfig(use_distributed_optimizer=True, expert_parallel_size=2, bucket_bytes=BUCKET_BYTES,
                               num_distributed_optimizer_instances=2, check_for_nan_in_grad=True)
    ddp = meshddp.DistributedDataParallel(model, mesh, dp_dim=("edp", "ep"), config=config, expert_params=["experts.*"])
    opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(lr=LR))
    loss = ddp(*batch(init, 0, rank, 2))
    if rank == 2:
        loss = loss + model.experts[str(model.first)]["w1"].sum() * float("nan")
    loss.backward()
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return None
