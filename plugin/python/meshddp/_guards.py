"""Guards between a meshddp.DistributedDataParallel and the torch code around it, each turning a
silent wrong result into a result that is right or an error that names the way out:

- torch's DistributedDataParallel around meshddp's would reduce meshddp's params a second time. The
  meshddp wrapper lists its params and buffers in `_ddp_params_and_buffers_to_ignore`, torch DDP's own
  mechanism, so that torch's DDP leaves them alone (wrapping meshddp's wrapper alone, torch's DDP then
  finds nothing to reduce and says so at construction); a torch DDP that reduces them anyway (meshddp's
  wrapper deeper inside the module it wraps) is refused at meshddp's forward, naming the param.
- meshddp around torch's DDP: refused at construction (the C++ engine refuses meshddp around meshddp).
  torch's DDP over the wrapped module itself, built while meshddp's wrapper lives, finds the same
  ignore list on the module and nothing left to reduce.
- A torch optimizer's step() while a gradient sync is pending (finish_grad_sync() forgotten), or on
  gradients accumulated under no_sync() that no sync ever began on: refused before the step, by a
  global optimizer step pre-hook. So is a torch optimizer's step() over a bf16
  or fp16 param whose gradient is reduced in fp32 (grad_reduce_in_fp32): its .grad is None (the
  gradient is param.main_grad), so the optimizer would skip the param without a word; and a torch
  optimizer's step() over the params of a wrapper built for the ZeRO-1 distributed optimizer
  (use_distributed_optimizer), whose ranks each hold the reduced gradient of their shard only: the
  ranks' params would diverge.
- ZeRO-1 with overlap_param_gather: a forward through the raw module (evaluation code holding the
  model, not the wrapper) waits, module by module, for the all-gathers of that module's own params
  (forward pre-hooks, as Megatron-core's DDP does), on any thread. Under torch.compile the hooks trace
  to nothing: the wrapper's forward waits for every pending gather before compiled code runs, and a raw
  module compiled on its own must be run after them (docs/guide/compile.md).
"""

import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.optim.optimizer import register_optimizer_step_pre_hook


def _error(what):
    return RuntimeError(f"meshddp.DistributedDataParallel: {what}")


def refuse_torch_ddp_inside(module):
    """meshddp around torch's DDP would reduce every gradient twice: refused, naming the module."""
    for name, m in module.named_modules():
        if isinstance(m, TorchDDP):
            where = "the module" if not name else f"module '{name}'"
            raise _error(f"{where} is a torch.nn.parallel.DistributedDataParallel, whose gradients torch already "
                         f"reduces; wrapping it in meshddp's would reduce them twice. Wrap the model once: give "
                         f"meshddp the model itself (torch_ddp.module), not torch's wrapper")


def names_for_torch_ddp(module):
    """The names torch's DDP, wrapping meshddp's wrapper, knows meshddp's params and buffers by: through
    the wrapper's named_parameters() (no prefix), its named_modules() ('module.' + name) and its own
    direct params ('.' + name); all three are listed."""
    names = []
    for n, _ in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False)):
        names += [n, f"module.{n}", f".{n}"]
    return names


def mark_wrapped_module(wrapper, module):
    """torch's DDP built later over the wrapped module itself (a second wrapper over the same model)
    would reduce its params on top of meshddp: the module gets the ignore list too while the wrapper
    lives (unless it has one of its own), so that torch's DDP finds nothing left to reduce and says so."""
    if hasattr(module, "_ddp_params_and_buffers_to_ignore"):
        return
    names = [n for n, _ in list(module.named_parameters(remove_duplicate=False)) +
             list(module.named_buffers(remove_duplicate=False))]
    module._ddp_params_and_buffers_to_ignore = names
    weakref.finalize(wrapper, _unmark, weakref.ref(module), names)


def _unmark(module_ref, names):
    module = module_ref()
    if module is not None and getattr(module, "_ddp_params_and_buffers_to_ignore", None) is names:
        del module._ddp_params_and_buffers_to_ignore


def remember_params(wrapper, module):
    """The module's params as wrapped, for check_params_unchanged at the first forward."""
    wrapper._params_at_wrap = list(module.named_parameters())


def check_params_unchanged(wrapper):
    """At the first forward: a param replaced since wrapping (parallelize_module, or a new nn.Parameter assigned,
    after the wrapper was built) would never be reduced or stepped, silently: refused naming it."""
    at_wrap, wrapper._params_at_wrap = wrapper._params_at_wrap, None
    if at_wrap is None:
        return
    now = dict(wrapper.module.named_parameters())
    for name, p in at_wrap:
        if now.get(name) is not p:
            raise _error(f"parameter '{name}' is not the tensor it was when the wrapper was built: it was replaced "
                         f"after wrapping (parallelize_module, or a new nn.Parameter assigned), and meshddp syncs the "
                         f"tensors it was given, so the new one would never be reduced or stepped. Parallelize the "
                         f"module (and replace params) before wrapping it")


def check_outer_torch_ddp(wrapper):
    """In meshddp's forward: refuses a torch DDP whose forward is running around it and that reduces
    one of meshddp's params. Checked once per torch DDP."""
    outer = TorchDDP._get_active_ddp_module()
    checked = wrapper._torch_ddp_checked
    if outer is None or (checked is not None and checked() is outer):
        return
    reduced = {id(p) for p in getattr(outer, "_module_parameters", ())}
    for name, p in wrapper.module.named_parameters():
        if id(p) in reduced and p.requires_grad:
            raise _error(
                f"parameter '{name}' is reduced by this meshddp DistributedDataParallel and also by the torch "
                f"DistributedDataParallel around it: its gradient would be averaged twice. Tell torch's DDP to leave "
                f"meshddp's params alone before wrapping: torch.nn.parallel.DistributedDataParallel."
                f"_set_params_and_buffers_to_ignore_for_model(model, names) with the names of meshddp's params and "
                f"buffers in the model torch wraps (or wrap the model with one DDP only)")
    wrapper._torch_ddp_checked = weakref.ref(outer)  # not the module itself: it would become a submodule


# -- torch optimizers stepping on unsynced gradients --------------------------------------------------
_live_wrappers = weakref.WeakSet()
_step_hook = None


def _before_optimizer_step(optimizer, args, kwargs):
    # meshddp's own DistributedOptimizer (a torch Optimizer, for torch's LR schedulers) finishes the
    # gradient sync itself in step(): only other optimizers must find it finished.
    if getattr(optimizer, "_finishes_grad_sync", False):
        return
    for ddp in list(_live_wrappers):
        engine = getattr(ddp, "_engine", None)
        if engine is None:
            continue
        if ddp._zero1_param_ids:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if id(p) in ddp._zero1_param_ids:
                        name = next(n for n, q in ddp.module.named_parameters() if q is p)
                        raise _error(
                            f"{type(optimizer).__name__}.step() on parameter '{name}', whose gradient is sharded for "
                            f"the distributed optimizer (DdpConfig data_parallel_sharding_strategy='{ddp._strategy}'): each DP "
                            f"rank holds the reduced gradient of its own shard only, so a torch optimizer would step "
                            f"every rank on a different gradient and the ranks' params would diverge. Use "
                            f"meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(...)), or build the wrapper with "
                            f"data_parallel_sharding_strategy='no_shard' for a torch optimizer")
        fp32_main_grads = ddp._fp32_main_grad_params
        for group in optimizer.param_groups if fp32_main_grads else ():
            for p in group["params"]:
                name = fp32_main_grads.get(id(p))
                if name is not None and p.grad is None:
                    raise _error(
                        f"{type(optimizer).__name__}.step() would skip parameter '{name}': it is {p.dtype} and its "
                        f"gradient is reduced in fp32 (DdpConfig grad_reduce_in_fp32), so its .grad is None and the "
                        f"gradient is in param.main_grad ({p.main_grad.dtype}), which torch optimizers do not read. "
                        f"Use meshddp.DistributedOptimizer (fp32 master weights; use_distributed_optimizer=True), or "
                        f"grad_reduce_in_fp32=False, or set p.grad = p.main_grad.to(p.dtype) yourself before step()")
        ids = ddp._param_ids
        steps_on_it = any(id(p) in ids for group in optimizer.param_groups for p in group["params"])
        if steps_on_it and engine.unsynced_grads_accumulated():
            raise _error(
                f"{type(optimizer).__name__}.step() was called on gradients that were accumulated (backward under "
                f"no_sync() or set_requires_gradient_sync(False)) but never synced "
                f"(the DistributedDataParallel of {_some_names(ddp)}): each rank would step on its own local "
                f"gradients and the ranks' params would diverge. Call ddp.finish_grad_sync() after the last "
                f"backward and before optimizer.step() (it averages what was accumulated), or run the last "
                f"micro-batch's backward outside no_sync()")
        if not engine.sync_pending():
            if ddp._grads_state == "synced" and steps_on_it:  # meshddp.pipelining refuses adding to them
                ddp._grads_state = "stepped"
            continue
        if steps_on_it:
            which = _some_names(ddp)
            raise _error(
                f"{type(optimizer).__name__}.step() was called while this step's gradient sync is still running "
                f"(the DistributedDataParallel of {which}): "
                f"finish_grad_sync() was not called after the last backward, so the optimizer would step on "
                f"gradients that are not averaged over the data-parallel ranks (each rank its own). Call "
                f"ddp.finish_grad_sync() after the last backward and before optimizer.step() (under "
                f"torch.distributed.pipelining: meshddp.pipelining.finalize_model_grads(stages), every stage of the rank)")


def _some_names(ddp):
    names = [n for n, _ in ddp.named_parameters()]
    return ", ".join(f"'{n}'" for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def watch_optimizer_steps(wrapper):
    """Registers the wrapper with the (one, global) torch optimizer step pre-hook."""
    global _step_hook
    wrapper._param_ids = frozenset(id(p) for p in wrapper.module.parameters())
    wrapper._zero1_param_ids = frozenset(
        id(p) for p in wrapper.module.parameters() if p.requires_grad) if wrapper.config.use_distributed_optimizer else ()
    # Trainable plain params whose main_grad (fp32) is not their .grad (bf16/fp16 with grad_reduce_in_fp32).
    wrapper._fp32_main_grad_params = {
        id(p): name for name, p in wrapper.module.named_parameters()
        if p.requires_grad and not isinstance(p, DTensor) and getattr(p, "main_grad", None) is not None
        and p.main_grad.dtype != p.dtype}
    _live_wrappers.add(wrapper)
    if _step_hook is None:
        _step_hook = register_optimizer_step_pre_hook(_before_optimizer_step)


# -- ZeRO-1 overlapped param gathers and the raw module's forward --------------------------------------
def guard_raw_forward(wrapper, module):
    """Forward pre-hooks on every module that holds params of its own: each waits for the pending
    all-gathers of the buckets holding them. Removed when the wrapper is collected."""
    ref = weakref.ref(wrapper)
    handles = []
    for m in module.modules():
        own = [p._local_tensor if isinstance(p, DTensor) else p for p in m.parameters(recurse=False)]
        if not own:
            continue

        def wait_for_own_params(_module, _args, own=own):
            # Traced by torch.compile (a compiled block, or the wrapped module compiled through the
            # wrapper): nothing, no graph break; the wrapper's forward has waited for every pending gather
            # before compiled code runs (meshddp/compile.py).
            if torch.compiler.is_compiling():
                return
            w = ref()
            if w is not None and w._engine.pending_param_gathers() > 0:
                w._engine.wait_param_gathers_of(own)

        handles.append(m.register_forward_pre_hook(wait_for_own_params))
    weakref.finalize(wrapper, _remove_all, handles)


def _remove_all(handles):
    for h in handles:
        h.remove()
