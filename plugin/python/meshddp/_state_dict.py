"""DistributedOptimizer.state_dict() / load_state_dict() in the form torch.distributed.checkpoint
(DCP) saves and reshards. Not the meshddp checkpoint format (optimizer.save_checkpoint): see
docs/reference/checkpoints.md for which to use when.

Note [The optimizer state for DCP]
  ZeRO-1 gives DP rank r the contiguous range [begin + r*n/dp, begin + (r+1)*n/dp) of every bucket
  (optimizer/shard_layout.h). A param lies in one bucket, so each rank owns at most one contiguous
  range of the flattened param, and the ranges tile it in DP rank order, with uneven sizes (a rank's
  range may stop at a param boundary or in padding). DTensor's Shard(0) wants torch's even chunks,
  so each state tensor of a param is a ShardedTensor over the *flattened* (local TP) param with one
  ShardMetadata per owning rank: (offset, numel) from the layout, which every rank computes for
  every DP rank without communication. DCP saves each rank's pieces and, at another DP size, reads
  each new range from whichever saved pieces overlap it. The local shards are views of the
  optimizer's own tensors (no copies), so dcp.load(sd) writes straight into the optimizer; then
  load_state_dict(sd) checks the dict, copies what is not already in place, sets the step count and
  the learning rates, writes the masters into the params and all-gathers them.

  The layout of the dict (torch's optimizer state_dict shape, keyed by parameter name as DCP
  wants, e.g. torch.distributed.checkpoint.state_dict.get_state_dict):
    {"state": {"<param>": {"exp_avg": ShardedTensor, "exp_avg_sq": ..., "master": ...}},
    (kind "muon": a Muon matrix has "momentum_buffer" instead of the two moments)
     "step": 0-dim int64 tensor, "lr": float, "param_groups": [{"lr": float, "weight_decay": float}],
     "param_dtypes": {"<param>": "bfloat16" | "float16" | "float32"}}
  "master" is there for bf16/fp16 params only (an fp32 param is its own master: it comes from the
  model's state_dict, which is to be saved and loaded with this one). "param_dtypes" (strings, which
  DCP saves and loads back into the dict) lets load_state_dict refuse a model of another dtype than the
  saved one: DCP casts the model's params silently, and a bf16 checkpoint read into an fp32 model would
  otherwise leave its fp32 masters unread (the model's dict has no "master" to read them into). With TP > 1 a param's state is
  its local TP shard's, keyed "<param>@tp<t>of<T>": it reshards over DP only; load at the same TP size.
"""

import warnings

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

_WHO = "meshddp.DistributedOptimizer.load_state_dict"


def _error(what):
    return RuntimeError(f"{_WHO}: {what}")


def _state_key(name, tp_rank, tp_size):
    return name if tp_size == 1 else f"{name}@tp{tp_rank}of{tp_size}"


def _ownership(engine, dp_size):
    """{param name: (param numel, [(dp rank, offset, numel)] in rank order)} from the ZeRO-1 layout."""
    owners = {}
    for r in range(dp_size):
        for name, offset, numel, param_numel in engine.zero1_segments(r):
            owners.setdefault(name, (param_numel, []))[1].append((r, offset, numel))
    return owners


def _kinds(opt, name, dtype, muon):
    """The state kinds of param `name` of `dtype` (as state_pieces() names them); `muon`: the names
    of the params Muon updates."""
    config = opt.config
    kinds = [] if dtype == torch.float32 else ["master"]
    if name in muon:
        return kinds + ["momentum_buffer"]  # a Muon matrix (torch.optim.Muon's name); the rest take AdamW
    if config.kind in ("adamw", "muon"):
        return kinds + ["exp_avg", "exp_avg_sq"]
    return kinds + (["momentum_buffer"] if config.momentum > 0 else [])


def build(opt):
    """The state dict of `opt` (a meshddp.DistributedOptimizer): see the Note."""
    from torch.distributed.tensor import DTensor

    # torch warns on every ShardedTensor use that it prefers DTensor, which cannot hold these uneven
    # ranges (see the Note); DCP itself still reads and writes ShardedTensors. Only that warning goes.
    warnings.filterwarnings("ignore", message="Please use DTensor instead and we are deprecating ShardedTensor",
                            category=FutureWarning)

    ddp = opt.ddp
    dp_ranks = dist.get_process_group_ranks(ddp._dp_group)
    local = {n: (p._local_tensor if isinstance(p, DTensor) else p) for n, p in ddp.module.named_parameters()}
    pieces = {(name, kind): (view, offset) for kind, name, view, offset in opt._impl.state_pieces()}
    state, dtypes = {}, {}
    muon = set(opt._impl.muon_params())
    for name, (param_numel, segments) in _ownership(ddp._engine, len(dp_ranks)).items():
        param = local[name]
        key = _state_key(name, ddp._tp_rank, ddp._tp_size)
        dtypes[key] = _dtype_name(param.dtype)
        per_param = state.setdefault(key, {})
        for kind in _kinds(opt, name, param.dtype, muon):
            shards_metadata = [ShardMetadata([off], [n], f"rank:{dp_ranks[r]}/{param.device}") for r, off, n in segments]
            view, offset = pieces.pop((name, kind), (None, None))
            if view is None:
                # This rank owns none of the param: an empty shard at its end. (DCP drops a ShardedTensor
                # without local shards from the rank's keys, then takes the dict for a pre-2.4 checkpoint's;
                # at offset 0 DCP's deduplication would keep the empty chunk instead of rank 0's.)
                view, offset = torch.empty(0, device=param.device), param_numel
                shards_metadata.append(ShardMetadata([param_numel], [0], f"rank:{dist.get_rank()}/{param.device}"))
            mine = [Shard(view, m) for m in shards_metadata
                    if m.shard_offsets[0] == offset and m.shard_sizes[0] == view.numel()
                    and m.placement.rank() == dist.get_rank()]
            assert len(mine) == 1, (name, kind, offset, view.numel(), segments)
            properties = TensorProperties(dtype=torch.float32, requires_grad=False)
            metadata = ShardedTensorMetadata(shards_metadata, torch.Size([param_numel]), properties)
            per_param[kind] = ShardedTensor._init_from_local_shards_and_global_metadata(mine, metadata)
    assert not pieces, f"state pieces of no known kind: {sorted(pieces)}"
    impl = opt._impl
    return {
        "state": state,
        "step": torch.tensor(impl.steps_taken(), dtype=torch.int64),
        "lr": float(impl.lr()),
        "param_groups": [{"lr": impl.group_lr(g), "weight_decay": impl.group_weight_decay(g)}
                         for g in range(impl.num_groups())],
        "param_dtypes": dtypes,
    }


def _dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


def _check_dtypes(expected, given):
    """Refuses a model of another dtype than the one saved (the "param_dtypes" of the saved dict, which
    dcp.load wrote into `given`), naming each param, as meshddp's own format does."""
    saved = given.get("param_dtypes")
    if not isinstance(saved, dict):
        return  # a dict made otherwise than by state_dict(): nothing to compare
    differ = [(key, saved[key], here) for key, here in expected.items() if key in saved and saved[key] != here]
    if not differ:
        return
    listed = "; ".join(f"'{key}' is {theirs} in the checkpoint but {here} here" for key, theirs, here in differ[:8])
    more = f" (and {len(differ) - 8} more)" if len(differ) > 8 else ""
    masters = any(theirs != "float32" and here == "float32" for _, theirs, here in differ)
    lost = (" The checkpoint's fp32 master weights of the low-precision params would be dropped: an fp32 model's "
            "dict has no 'master' for dcp.load to read them into, and its params hold the saved low-precision "
            "values widened." if masters else "")
    raise _error(f"the model's dtypes differ from the checkpoint's: {listed}{more}.{lost} Cast the model to the dtype "
                 f"it was saved in (e.g. model.to(torch.bfloat16)) before wrapping it, build the optimizer, then "
                 f"dcp.load and load_state_dict again (dcp.load has already written the saved values into this "
                 f"model's params); nothing was loaded into the optimizer")


def _why_other_states(config, name, takes_muon):
    """The way out when a param's states are another optimizer's: another kind, or under kind="muon"
    (a param holds "momentum_buffer" when Muon steps it, AdamW's two moments otherwise) other
    muon_adamw_params or muon_stacked_matrices (which take 3-D params) than it was saved with."""
    kind = f"saved by another optimizer kind? this one is {config.kind}"
    if config.kind != "muon":
        return kind
    return (f"{kind}; or, saved by kind='muon', with other settings: '{name}' is stepped by "
            f"{'Muon' if takes_muon else 'AdamW'} here (muon_adamw_params={config.muon_adamw_params!r}, "
            f"muon_stacked_matrices={config.muon_stacked_matrices}): load with the muon_adamw_params and "
            f"muon_stacked_matrices it was saved with")


def load(opt, state_dict):
    """Applies `state_dict` (this optimizer's state_dict(), filled by dcp.load) to `opt`. Every rank
    checks the whole dict, and all agree, before any changes anything; a collective over the mesh."""
    try:
        # Not mid-step: the loaded params would get the old ones' gradients (ddp.load_state_dict refuses
        # the same); pending param all-gathers finish first (they would overwrite the loaded params).
        opt.ddp._engine.before_params_written(_WHO)
        plan = _check(opt, state_dict)
        error = None
    except RuntimeError as e:
        plan, error = None, e
    except Exception as e:  # noqa: BLE001 (a malformed dict: this rank must still take part in the agreement)
        plan, error = None, _error(f"the state dict is malformed: {type(e).__name__}: {e}")
    # All ranks commit or none does: a rank that stopped here would leave the others in the all-gather.
    _agree(opt, plan, error)
    copies, step, lr, groups = plan
    with torch.no_grad():
        for dst, src in copies:
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
    if lr is not None:
        opt._impl.set_lr(float(lr))
    for g, group in enumerate(groups):
        opt._impl.set_group_lr(g, float(group["lr"]))
        opt._impl.set_group_weight_decay(g, float(group["weight_decay"]))
    opt._impl.finish_state_dict_load(step)


def _scalars(opt, plan):
    """{field: [values]} of the settings every rank must load alike (zeros where this rank's check failed)."""
    groups = opt._impl.num_groups()
    if plan is None:
        return {"step": [0.0], "lr": [0.0], "param_groups": [0.0] * 2 * groups}
    _, step, lr, given = plan
    return {"step": [float(step)], "lr": [-1.0 if lr is None else float(lr)],
            "param_groups": [float(g[f]) for g in given for f in ("lr", "weight_decay")]}


def _agree(opt, plan, error):
    """One all-reduce over the mesh: did any rank fail its check, and do all ranks' step count, base LR
    and param groups match? (Each rank checks only its own dict; ranks that read different checkpoints,
    or changed one rank's dict, would otherwise each update their shard with other settings.) Raises on
    every rank unless all agree."""
    scalars = _scalars(opt, plan)
    values = [v for field in scalars.values() for v in field]
    device = next(opt.ddp.module.parameters()).device
    # MAX of [failed, v, -v] gives any failure, the max of each value and minus its min.
    both = torch.tensor([0.0 if error is None else 1.0] + values + [-v for v in values], dtype=torch.float64,
                        device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=opt.ddp._world_group)
    both = both.cpu().tolist()
    if error is not None:
        raise error
    if both[0]:
        raise _error("another rank found the state dict unusable (its error says why); nothing was loaded")
    highest, lowest = both[1:1 + len(values)], [-v for v in both[1 + len(values):]]
    i = 0
    for field, mine in scalars.items():
        span = slice(i, i + len(mine))
        if highest[span] != lowest[span]:
            raise _error(f"the ranks' state dicts differ in {field} (this rank's: {mine}; lowest over the ranks: "
                         f"{lowest[span]}, highest: {highest[span]}); every rank must load the same checkpoint "
                         f"(dcp.load with the same checkpoint_id on every rank); nothing was loaded")
        i += len(mine)


def _check(opt, state_dict):
    """(copies [(ours, theirs)], step, base lr or None, param groups), or a RuntimeError naming what
    does not fit."""
    if not isinstance(state_dict, dict):
        raise _error(f"state_dict must be a dict (from state_dict()), got {type(state_dict).__name__}")
    groups = state_dict.get("param_groups")
    if isinstance(groups, list) and any(isinstance(g, dict) and "params" in g for g in groups):
        raise _error("this is a torch.optim optimizer's state_dict() (param_groups list 'params' by index), not a "
                     "meshddp.DistributedOptimizer's: its state is whole tensors keyed by index, meshddp's is "
                     "sharded over DP and keyed by parameter name. Load the model weights with "
                     "ddp.load_state_dict(...) and start the optimizer state afresh, or resume from a checkpoint "
                     "saved with {'optim': DistributedOptimizer.state_dict()}")
    for field in ("state", "step", "param_groups"):
        if field not in state_dict:
            raise _error(f"the state dict has no '{field}' (it holds {sorted(state_dict)}); pass the dict that "
                         f"DistributedOptimizer.state_dict() returned, filled by torch.distributed.checkpoint.load")
    expected = build(opt)
    given = state_dict["state"]
    missing = sorted(set(expected["state"]) - set(given))
    unexpected = sorted(set(given) - set(expected["state"]))
    if missing or unexpected:
        raise _error(f"the parameters differ from this optimizer's: missing {missing}, unexpected {unexpected}; "
                     f"the model and the optimizer config (and, with TP, the TP size) must be those it was saved with")
    copies = []
    for name, kinds in expected["state"].items():
        for kind, ours in kinds.items():
            theirs = given[name].get(kind) if isinstance(given[name], dict) else None
            if theirs is None:
                has = sorted(given[name]) if isinstance(given[name], dict) else type(given[name]).__name__
                raise _error(f"parameter '{name}' has no '{kind}' state in the state dict (it has {has}); "
                             + _why_other_states(opt.config, name, "momentum_buffer" in kinds))
            if not isinstance(theirs, ShardedTensor):
                raise _error(f"parameter '{name}' '{kind}': expected a ShardedTensor (from state_dict()), got "
                             f"{type(theirs).__name__}")
            if tuple(theirs.size()) != tuple(ours.size()):
                raise _error(f"parameter '{name}' '{kind}' has {tuple(theirs.size())[0]} elements in the state dict "
                             f"but {tuple(ours.size())[0]} in this model (the flattened local parameter); a "
                             f"different model or TP size?")
            mine = {s.metadata.shard_offsets[0]: s.tensor for s in ours.local_shards()}
            got = {s.metadata.shard_offsets[0]: s.tensor for s in theirs.local_shards()}
            if {o: t.numel() for o, t in got.items()} != {o: t.numel() for o, t in mine.items()}:
                raise _error(f"parameter '{name}' '{kind}': this rank's shard of the state dict covers "
                             f"{sorted((o, t.numel()) for o, t in got.items())} (offset, numel) but this rank owns "
                             f"{sorted((o, t.numel()) for o, t in mine.items())}: a state dict of another DP size "
                             f"must be read through torch.distributed.checkpoint (dcp.load into this optimizer's "
                             f"state_dict()), which reshards it")
            copies += [(mine[o], got[o]) for o in mine]
    _check_dtypes(expected["param_dtypes"], state_dict)
    groups = state_dict["param_groups"]
    if len(groups) != opt._impl.num_groups():
        raise _error(f"the state dict has {len(groups)} param groups but this optimizer {opt._impl.num_groups()} "
                     f"(the default group, then one per OptimizerConfig.groups rule)")
    for g, group in enumerate(groups):
        for field in ("lr", "weight_decay"):
            value = group.get(field) if isinstance(group, dict) else None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise _error(f"param_groups[{g}]['{field}'] must be a finite number >= 0, got {value!r}")
    step = state_dict["step"]
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_floating_point() and not step.is_complex() \
            and step.dtype != torch.bool:
        step = int(step.item())
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise _error(f"step must be an int >= 0 or a one-element integer tensor (as state_dict() gives), got {step!r}")
    lr = state_dict.get("lr")
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 <= lr < float("inf")):
        raise _error(f"lr must be a finite number >= 0, got {lr!r}")
    return copies, step, lr, groups
