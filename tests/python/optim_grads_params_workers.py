"""Rank functions for test_optim_grads_params.py: meshddp.DistributedDataParallel under
data_parallel_sharding_strategy='optim_grads_params' (ZeRO-3) from Python, on example 03's GPT (4 blocks, LM
head tied to the embedding; units: wte, wpe, blocks.0..3, ln_f), against 'optim' (ZeRO-1) at the same DP size
and against one process (torch.optim.AdamW on the whole global batch), with and without gradient accumulation;
the param storage it holds; its refusals; state dicts (meshddp's format and DCP) across the two strategies."""

import importlib.util
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import meshddp

STEPS = 3
GLOBAL_BATCH = 8
LR = 0.01
VOCAB, SEQ, DIM, HEADS, LAYERS = 64, 8, 32, 4, 4
SAVE_AT = 2  # checkpoint cases: steps before the save
CONTINUE = 2  # and after the load


def _example():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "03_python_gpt", "train.py")
    spec = importlib.util.spec_from_file_location("example_03_train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _example()


def gpt(seed=0):
    torch.manual_seed(seed)
    return example.Gpt(vocab=VOCAB, seq_len=SEQ, dim=DIM, heads=HEADS, layers=LAYERS)


def loss_of(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def build(world_size, strategy, seed=0, bucket_bytes=4096):
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    ddp = meshddp.DistributedDataParallel(gpt(seed), mesh, config=meshddp.DdpConfig(
        bucket_bytes=bucket_bytes, data_parallel_sharding_strategy=strategy))
    opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="adamw", lr=LR, weight_decay=0.01))
    return ddp, opt


def train(ddp, opt, rank, world_size, steps, micro_batches=1, seen=None):
    """Each step: this rank's rows of the global batch in `micro_batches` slices, the first ones under
    no_sync(). Returns the global mean losses. seen: a dict that gets, per step, whether any param's .grad was
    set after backward, and the param storage held after the step."""
    n = GLOBAL_BATCH // world_size
    losses = []
    for step in steps:
        ddp.zero_grad_buffer()
        ids, targets = example.make_batch(VOCAB, SEQ, 1, step, GLOBAL_BATCH)
        ids, targets = ids[rank * n:(rank + 1) * n], targets[rank * n:(rank + 1) * n]
        total = torch.zeros(())
        for m, (x, y) in enumerate(zip(ids.chunk(micro_batches), targets.chunk(micro_batches))):
            last = m == micro_batches - 1
            with ddp.no_sync() if not last else _nothing():
                loss = loss_of(ddp(x), y) / micro_batches
                loss.backward()
            total += loss.detach()
        if seen is not None:
            seen.setdefault("grads", []).append(any(p.grad is not None for p in ddp.parameters()))
        opt.step()
        if seen is not None:
            seen.setdefault("storage", []).append(ddp.param_storage_bytes())
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    opt.finish_param_sync()
    return losses


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def params_of(ddp):
    """Whole copies of the params (state_dict(): a collective under optim_grads_params; views under optim)."""
    return [t.clone() for k, t in ddp.state_dict().items() if k != "head.weight"]


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def one_process(micro_batches):
    """The golden: the same model, torch.optim.AdamW on the whole global batch (one mean over it)."""
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for step in range(STEPS):
        opt.zero_grad()
        ids, targets = example.make_batch(VOCAB, SEQ, 1, step, GLOBAL_BATCH)
        loss_of(model(ids), targets).backward()
        opt.step()
    return [t for k, t in model.state_dict().items() if k != "head.weight"]


def against_optim_and_one_process(rank, world_size, micro_batches):
    """optim_grads_params' params after STEPS steps vs optim's and vs one process; param storage of both."""
    golden = one_process(micro_batches)
    out = {}
    for strategy in ("optim", "optim_grads_params"):
        ddp, opt = build(world_size, strategy)
        ddp.reset_peak_param_storage()
        seen = {}
        losses = train(ddp, opt, rank, world_size, range(STEPS), micro_batches, seen)
        out[strategy] = {"losses": losses, "seen": seen, "now": ddp.param_storage_bytes(),
                         "peak": ddp.peak_param_storage_bytes(), "shards": ddp.param_shard_bytes(),
                         "params": params_of(ddp)}
        out[strategy]["after_state_dict"] = ddp.param_storage_bytes()
    sharded, zero1 = out["optim_grads_params"], out["optim"]
    return {"vs_optim": max_diff(sharded["params"], zero1["params"]),
            "vs_one": max_diff(sharded["params"], golden), "optim_vs_one": max_diff(zero1["params"], golden),
            "losses": (zero1["losses"], sharded["losses"]), "grads_seen": sharded["seen"]["grads"],
            "storage_after_steps": sharded["seen"]["storage"], "shards": sharded["shards"],
            "peak": sharded["peak"], "after_state_dict": sharded["after_state_dict"], "whole": zero1["now"],
            "largest_unit": max(4 * sum(p.numel() for p in b.parameters()) for b in ddp.module.blocks),
            "strategy": ddp.config.data_parallel_sharding_strategy}


def _message(fn, kinds=(RuntimeError,)):
    try:
        fn()
    except kinds as e:
        return str(e)
    return None


def refusals(rank, world_size):
    """The messages of what optim_grads_params refuses from Python (each caught: every rank goes on alike); and
    the FSDP units of the default fsdp_unit_modules and of "blocks.*", by name."""
    ddp, opt = build(world_size, "optim_grads_params")
    train(ddp, opt, rank, world_size, range(1))
    weight = ddp.module.blocks[2].fc1.weight
    out = {"getattr": getattr(weight, "main_grad", "absent"),
           "attribute": _message(lambda: weight.main_grad, AttributeError),
           "method": _message(lambda: ddp.main_grad("blocks.2.fc1.weight"), AttributeError),
           "read": _message(lambda: weight.sum()), "write": _message(lambda: _write(weight)),
           "storage_bytes": weight.untyped_storage().nbytes()}
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.1)
    out["torch_optimizer"] = _message(sgd.step)
    out["default_units"] = ddp._engine.fsdp_unit_names()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    out["block_units"] = meshddp.DistributedDataParallel(gpt(), mesh, config=meshddp.DdpConfig(
        data_parallel_sharding_strategy="optim_grads_params", fsdp_unit_modules="blocks.*"))._engine.fsdp_unit_names()
    return out


def _write(weight):
    with torch.no_grad():
        weight.mul_(2)


def backward_reads_gathered_params(rank, world_size):
    """After a forward every unit is released (storage without bytes); backward must gather each again to read
    its weights: the gradients reduce-scattered then equal 'optim''s (compared through one SGD step, lr 1)."""
    out = {}
    for strategy in ("optim", "optim_grads_params"):
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
        ddp = meshddp.DistributedDataParallel(gpt(), mesh, config=meshddp.DdpConfig(
            bucket_bytes=4096, data_parallel_sharding_strategy=strategy))
        opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="sgd", lr=1.0))
        ids, targets = example.make_batch(VOCAB, SEQ, 1, 0, GLOBAL_BATCH)
        n = GLOBAL_BATCH // world_size
        ddp.zero_grad_buffer()
        loss = loss_of(ddp(ids[rank * n:(rank + 1) * n]), targets[rank * n:(rank + 1) * n])
        out[strategy + "_released_after_forward"] = ddp.param_storage_bytes() == ddp.param_shard_bytes()
        loss.backward()
        opt.step()
        opt.finish_param_sync()
        out[strategy] = params_of(ddp)
    out["diff"] = max_diff(out["optim"], out["optim_grads_params"])
    return {k: v for k, v in out.items() if k not in ("optim", "optim_grads_params")}


def checkpoint_save(rank, world_size, directory):
    """SAVE_AT steps under each of optim / optim_grads_params, then DCP and meshddp's format."""
    out = {}
    for strategy in ("optim", "optim_grads_params"):
        ddp, opt = build(world_size, strategy)
        out[strategy] = train(ddp, opt, rank, world_size, range(SAVE_AT))
        dcp.save({"model": ddp.state_dict(), "optim": opt.state_dict()},
                 checkpoint_id=os.path.join(directory, strategy, "dcp"))
        opt.save_checkpoint(os.path.join(directory, strategy, "meshddp"))
    return out


def checkpoint_resume(rank, world_size, directory):
    """Each checkpoint loaded under the other strategy at this DP size (into a model built with other values):
    through DCP and through meshddp's format, CONTINUE steps each; and the uninterrupted run at this size."""
    out = {}
    for saved, loaded in (("optim", "optim_grads_params"), ("optim_grads_params", "optim")):
        ddp, opt = build(world_size, loaded)
        full_losses = train(ddp, opt, rank, world_size, range(SAVE_AT + CONTINUE))
        full = params_of(ddp)

        ddp, opt = build(world_size, loaded, seed=1)
        sd = {"model": ddp.state_dict(), "optim": opt.state_dict()}
        dcp.load(sd, checkpoint_id=os.path.join(directory, saved, "dcp"))
        ddp.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        after_load = params_of(ddp)
        dcp_losses = train(ddp, opt, rank, world_size, range(SAVE_AT, SAVE_AT + CONTINUE))
        resumed = params_of(ddp)

        ddp, opt = build(world_size, loaded, seed=2)
        opt.load_checkpoint(os.path.join(directory, saved, "meshddp"))
        own_after_load = params_of(ddp)
        own_losses = train(ddp, opt, rank, world_size, range(SAVE_AT, SAVE_AT + CONTINUE))
        out[f"{saved}->{loaded}"] = {
            "full_losses": full_losses, "dcp_losses": dcp_losses, "own_losses": own_losses,
            "loaded_vs_own": max_diff(after_load, own_after_load), "after_load": after_load,
            "vs_own": max_diff(resumed, params_of(ddp)), "vs_full": max_diff(resumed, full)}
    pairs = list(out.values())
    loaded = max_diff(pairs[0].pop("after_load"), pairs[1].pop("after_load"))
    return {"pairs": out, "optim_vs_sharded_checkpoint": loaded}


class TwoUnitsInOneOp(torch.nn.Module):
    """Ops whose arguments live in two FSDP units: an LM head tied to the embedding with its own bias (BERT's;
    units 'wte' and 'head'), and `body.weight + other.weight` (units 'body' and 'other')."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(VOCAB, DIM)
        self.body = torch.nn.Linear(DIM, DIM)
        self.other = torch.nn.Linear(DIM, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)
        self.head.weight = self.wte.weight

    def forward(self, ids):
        h = torch.tanh(self.body(self.wte(ids)))
        return self.head(F.linear(h, self.body.weight + self.other.weight))


def one_op_reading_two_units(rank, world_size):
    """TwoUnitsInOneOp under optim_grads_params vs optim: the params after STEPS AdamW steps (0: bit for bit)."""
    out = {}
    for strategy in ("optim", "optim_grads_params"):
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
        ddp = meshddp.DistributedDataParallel(TwoUnitsInOneOp(), mesh, config=meshddp.DdpConfig(
            bucket_bytes=4096, data_parallel_sharding_strategy=strategy))
        opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="adamw", lr=LR))
        g = torch.Generator().manual_seed(rank)
        for _ in range(STEPS):
            ddp.zero_grad_buffer()
            ids = torch.randint(0, VOCAB, (4, SEQ), generator=g)
            loss_of(ddp(ids), ids).backward()
            opt.step()
        opt.finish_param_sync()
        out[strategy] = [v for v in ddp.state_dict().values()]
    return max((a - b).abs().max().item() for a, b in zip(out["optim"], out["optim_grads_params"]))


def dropped_wrapper(rank, world_size):
    """The wrapped module's own state_dict() between steps, and wrapping its module again after the wrapper
    is dropped: the messages (each refused on every rank)."""
    ddp, opt = build(world_size, "optim_grads_params")
    train(ddp, opt, rank, world_size, range(1))
    out = {"module_state_dict": _message(lambda: ddp.module.state_dict())}
    module = ddp.module
    del ddp, opt
    import gc
    gc.collect()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    out["rewrap"] = _message(lambda: meshddp.DistributedDataParallel(module, mesh))
    return out
