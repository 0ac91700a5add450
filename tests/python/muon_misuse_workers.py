"""Workers for test_muon_misuse.py: Muon (meshddp.DistributedOptimizer(kind="muon")) given models and
settings it must refuse by name or handle."""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import meshddp


class UnevenTp(torch.nn.Module):
    """`w` (rows x 32) sharded on dim 0 over TP with distribute_tensor: uneven pieces when TP does not
    divide `rows` (63 over 2: 32 and 31 rows)."""

    def __init__(self, tp_mesh, rows):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(distribute_tensor(torch.randn(rows, 32), tp_mesh, [Shard(0)]))
        self.v = torch.nn.Parameter(torch.randn(4, rows))

    def forward(self, x):
        return torch.tanh(x @ self.w.full_tensor().T) @ self.v.T


def uneven_tp_pieces(rank, world_size, rows, kind="muon", tp=2):
    """Two steps at dp (world_size / tp) x tp: None, or the error text."""
    mesh = init_device_mesh("cpu", (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
    ddp = meshddp.DistributedDataParallel(UnevenTp(mesh["tp"], rows), mesh, config=meshddp.DdpConfig(
        use_distributed_optimizer=True, shard_policy="whole_param"))
    try:
        opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind=kind, lr=0.02))
    except RuntimeError as e:
        return str(e)
    for _ in range(2):
        ddp.zero_grad_buffer()
        ddp(torch.randn(4, 32)).square().mean().backward()
        opt.step()
    opt.finish_param_sync()
    return None


class Gpt2Names(torch.nn.Module):
    """GPT-2's names: the token embedding "wte" and the head "lm_head" (default muon_adamw_params
    catch the head by name, not the embedding)."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(16, 32)
        self.fc = torch.nn.Linear(32, 32)
        self.lm_head = torch.nn.Linear(32, 16)

    def forward(self, idx):
        return self.lm_head(torch.tanh(self.fc(self.wte(idx))))


def muon_params_and_warnings(rank, world_size, muon_adamw_params):
    """The params Muon takes, the warnings the optimizer raised, and memory(), on Gpt2Names."""
    import warnings

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = Gpt2Names()
    ddp = meshddp.DistributedDataParallel(model, mesh, config=meshddp.DdpConfig(
        use_distributed_optimizer=True, shard_policy="whole_param"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="muon", muon_adamw_params=muon_adamw_params))
    numel = {n: p.numel() for n, p in model.named_parameters()}
    return {"muon": opt.muon_params, "warnings": [str(w.message) for w in caught if "Muon" in str(w.message)],
            "memory": opt.memory(), "numel": numel}


def ranks_with_other_muon_settings(rank, world_size, field, values):
    """Rank r builds its optimizer with `field` = values[r]: the error text, or None."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    ddp = meshddp.DistributedDataParallel(Gpt2Names(), mesh, config=meshddp.DdpConfig(
        use_distributed_optimizer=True, shard_policy="whole_param"))
    try:
        meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="muon", **{field: values[rank]}))
    except RuntimeError as e:
        return str(e)
    return None


def instances_with_clipping(rank, world_size, kind):
    """dp 4 (a 1-D mesh) in 2 optimizer instances, clip_grad_norm below the norm: this rank's grad
    norms, clip flags and final params."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = Gpt2Names()
    ddp = meshddp.DistributedDataParallel(model, mesh, config=meshddp.DdpConfig(
        use_distributed_optimizer=True, shard_policy="whole_param", num_distributed_optimizer_instances=2))
    opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind=kind, lr=0.02, clip_grad_norm=0.05))
    norms, clipped = [], []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, 16, (world_size, 3), generator=g)
        ddp.zero_grad_buffer()
        ddp(idx[rank:rank + 1]).square().mean().backward()
        r = opt.step()
        norms.append(r.grad_norm)
        clipped.append(r.clipped)
    opt.finish_param_sync()
    return {"norms": norms, "clipped": clipped, "params": [p.detach().clone() for p in model.parameters()]}
