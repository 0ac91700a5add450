"""The Python side of data_parallel_sharding_strategy='optim_grads_params' (ZeRO-3, docs/reference/sharding.md):
the wrapper's state_dict() and load_state_dict() when a rank holds only its shards of the params.

Note [Whole-param state dicts under optim_grads_params]
  Each trainable param is a view of its bucket's storage, which has bytes only while its FSDP unit is in use
  (Note [Sharded parameters], grad_buffer/sharded_params.h): outside a forward, reading it is refused naming
  the param. So state_dict() gathers every unit (a collective over DP: every rank calls it, as DCP's save
  does), clones each value and releases the units again: the dict holds whole tensors, the same keys, shapes
  and values as under 'optim', and a checkpoint saved under one strategy loads under the other, at any DP
  size (DCP reshards whole tensors itself). The cost is a transient copy of the whole model on every rank
  while the dict lives (as FSDP's FULL_STATE_DICT without CPU offload). load_state_dict() writes into this
  rank's shards only: each piece of a shard (a contiguous range of one flattened param, the layout's
  segments) takes its range of the given whole tensor; the units are gathered from the shards on their next
  use, and the optimizer's fp32 masters are refreshed from them before its next step."""

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

_WHO = "meshddp.DistributedDataParallel.load_state_dict"


def _error(what):
    return RuntimeError(f"{_WHO}: {what}")


def state_dict(ddp, *args, **kwargs):
    """The module's state_dict with every tensor a whole copy (see the Note). Collective over DP."""
    ddp._engine.gather_all_params()
    try:
        with torch.no_grad():
            out = ddp.module.state_dict(*args, **kwargs)
            for key, value in out.items():
                if isinstance(value, torch.Tensor):
                    out[key] = value.detach().clone()
            return out
    finally:
        ddp._engine.release_all_params()


def load_state_dict(ddp, given, strict=True):
    """Writes `given` (whole tensors by module path, as state_dict() gives them) into this rank's shards, the
    frozen params and the buffers. Checks every key and shape before anything is written. Not collective."""
    module = ddp.module
    module._meshddp_views_only = True  # shapes only: refuse_released_in_state_dict lets it through
    try:
        own = module.state_dict()  # views: they read nothing
    finally:
        module._meshddp_views_only = False
    missing = [k for k in own if k not in given]
    unexpected = [k for k in given if k not in own]
    if strict and (missing or unexpected):
        raise _error(f"the state dict does not fit the module: missing {missing[:8]}, unexpected {unexpected[:8]}"
                     f"{' (and more)' if len(missing) > 8 or len(unexpected) > 8 else ''}; pass every parameter and "
                     f"buffer of the module (strict=False to load only some)")
    for key, value in given.items():
        if key in own and (not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(own[key].shape)):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise _error(f"'{key}' has shape {shape} in the state dict but {tuple(own[key].shape)} in the module")
    sharded = set(ddp._engine.param_names())
    aliases = {}  # a tied param's other names, for a dict that holds it under one of them only
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    module_name = {engine: name for name, engine in ddp._engine_names.items()}  # expert DTensors: engine names
    with torch.no_grad():
        # Every value as this rank holds it (a DTensor's: its local shard), made before anything is written (a
        # value that cannot be made fails with nothing changed) and in the same order on every rank (a DTensor
        # given at other placements is redistributed: a collective over TP).
        local = {}
        for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
            names = aliases.get(id(tensor), [name])
            source = next((given[n] for n in names if n in given), None)
            if source is not None:
                local[name] = _local_values(source.detach(), tensor)
    ddp._engine.before_params_written(_WHO)
    try:
        with torch.no_grad():
            for name, offset, piece in ddp._engine.param_shard_pieces():
                source = local.get(module_name.get(name, name))
                if source is not None:
                    flat = source.reshape(-1)[offset:offset + piece.numel()]
                    piece.copy_(flat.to(device=piece.device, dtype=piece.dtype))
            for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
                if name not in sharded and name in local:  # frozen params and buffers: whole on every rank
                    (tensor.to_local() if isinstance(tensor, DTensor) else tensor).copy_(local[name])
    finally:
        ddp._engine.notify_params_changed()  # also after a partial load: the masters are reloaded
    return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)


def _local_values(source, param):
    """What this rank holds of `source` (a whole tensor or a DTensor) for `param` (or a buffer): for a DTensor its
    local shard at its placements (a whole tensor is cut locally, as distribute_tensor without a source rank)."""
    if not isinstance(param, DTensor):
        return source.full_tensor() if isinstance(source, DTensor) else source
    if isinstance(source, DTensor):
        if source.device_mesh == param.device_mesh and source.placements == param.placements:
            return source.to_local()
        return source.redistribute(param.device_mesh, param.placements).to_local()
    return distribute_tensor(source, param.device_mesh, param.placements, src_data_rank=None).to_local()


def _released(value):
    return isinstance(value, torch.Tensor) and value.numel() > 0 and value.untyped_storage().nbytes() == 0


def refuse_released_in_state_dict(module):
    """A post-hook on the wrapped module's state_dict(): under optim_grads_params `ddp.module.state_dict()`
    called directly would hold views of released storage (no bytes: torch.save writes no values, and the
    load fails later), so it raises naming the first such key and ddp.state_dict(), which gathers."""

    def check(mod, out, prefix, local_metadata):
        if getattr(mod, "_meshddp_views_only", False):
            return
        for key, value in out.items():
            if key.startswith(prefix) and _released(value):
                raise RuntimeError(
                    f"meshddp.DistributedDataParallel: the wrapped module's state_dict() holds '{key}' while its FSDP "
                    f"unit is released (data_parallel_sharding_strategy='optim_grads_params' keeps only this rank's "
                    f"shards between steps), so it has no values to save. Call ddp.state_dict() on every rank (it "
                    f"gathers the units and returns whole copies), or use data_parallel_sharding_strategy='optim'")

    return module.register_state_dict_post_hook(check)
