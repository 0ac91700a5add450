"""The Python side of data_parallel_sharding_strategy='optim_grads' (ZeRO-2, docs/guide/sharding.md) and
'optim_grads_params' (ZeRO-3), which shards the gradients the same way: no
rank holds a whole gradient, so `param.main_grad` (Megatron's and veScale's name for a param's slot in the
flat buffer) has nothing to be a view of. Reading it raises an AttributeError that says why and what to use
instead, rather than the bare "object has no attribute" (code that probes it with getattr(p, "main_grad",
None) or hasattr() still sees it absent, as Megatron-FSDP's own checks expect).

The attribute is a data descriptor on a subclass of the param's class, made once per class and assigned
to the param's __class__ (isinstance(p, nn.Parameter) still holds; state_dict() detaches, so checkpoints
never see the subclass)."""

import torch

_SUBCLASSES = {}  # the param's original class -> its subclass with the refusing main_grad
_NAME = "_meshddp_grad_shard_name"  # the param's module path, for the message
_STRATEGY = "_meshddp_grad_shard_strategy"  # the wrapper's strategy, for the message
_ZERO = {"optim_grads": "ZeRO-2", "optim_grads_params": "ZeRO-3"}


def no_whole_main_grad(what, name, strategy="optim_grads"):
    """The error for reading a whole gradient of param `name` under `strategy` (optim_grads or
    optim_grads_params; `what`: the expression)."""
    return AttributeError(
        f"meshddp.DistributedDataParallel: {what}: parameter '{name}' has no whole gradient under "
        f"data_parallel_sharding_strategy='{strategy}' ({_ZERO.get(strategy, strategy)}): after each bucket's "
        f"reduce-scatter a rank keeps "
        f"only its shard of the gradient, and param.grad is None after backward. meshddp.DistributedOptimizer "
        f"steps the shards; clip with DistributedOptimizerConfig(clip_grad_norm=...) and read the norm from "
        f"StepResult.grad_norm. To read whole gradients, use data_parallel_sharding_strategy='optim'")


class _RefusedMainGrad:
    """param.main_grad under optim_grads: reading, setting or deleting it raises, naming the param."""

    def __get__(self, param, owner=None):
        if param is None:
            return self
        raise no_whole_main_grad("param.main_grad", *_named(param))

    def __set__(self, param, value):
        raise no_whole_main_grad("setting param.main_grad", *_named(param))

    def __delete__(self, param):
        raise no_whole_main_grad("deleting param.main_grad", *_named(param))


def _named(param):
    return param.__dict__.get(_NAME, "?"), param.__dict__.get(_STRATEGY, "optim_grads")


def refuse_main_grad(param, name, strategy="optim_grads"):
    """Makes `param.main_grad` raise (see the module's docstring), naming `name` and `strategy`. A main_grad left by an
    earlier wrapper (a view of a buffer that is gone) is dropped."""
    param.__dict__.pop("main_grad", None)
    param.__dict__[_NAME] = name
    param.__dict__[_STRATEGY] = strategy
    cls = type(param)
    if "main_grad" in vars(cls) and isinstance(vars(cls)["main_grad"], _RefusedMainGrad):
        return
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls,), {"main_grad": _RefusedMainGrad(), "__module__": cls.__module__,
                                           "__doc__": cls.__doc__})
        _SUBCLASSES[cls] = sub
    param.__class__ = sub


def is_refusing(param):
    """Whether `param.main_grad` is refused (wrapped under optim_grads)."""
    return isinstance(param, torch.Tensor) and isinstance(vars(type(param)).get("main_grad"), _RefusedMainGrad)


def allow_main_grad(param):
    """Undoes refuse_main_grad (the param wrapped again under another strategy): its own class back."""
    if is_refusing(param):
        param.__class__ = type(param).__bases__[0]
        param.__dict__.pop(_NAME, None)
        param.__dict__.pop(_STRATEGY, None)


def hand_dtensor_grad_to(param, local, owner):
    """optim_grads with a DTensor param (torch TP): no whole gradient buffer exists for its .grad to be a
    DTensor over (Note [DTensor parameters], python_ddp.h), so each new DTensor gradient autograd stores
    in `param.grad` is moved, after accumulation, onto the local tensor the engine holds (`local.grad`),
    at the param's own placements (a Partial gradient is reduced over TP first, as DTensor's in-place add
    does under 'optim'), and `param.grad` is set back to None. The engine's post-hook on the same
    AccumulateGrad node runs next (torch runs tensor post-accumulate hooks first) and adds `local.grad`
    into its bucket's block. `owner`: the wrapper, held weakly; once it is gone the hook does nothing.
    Returns the hook's handle."""
    import weakref

    from torch.distributed.tensor import DTensor

    owner_ref = weakref.ref(owner)

    def move_to_local(p):
        if owner_ref() is None or p.grad is None:
            return
        grad = p.grad
        with torch.no_grad():
            if isinstance(grad, DTensor):
                if tuple(grad.placements) != tuple(p.placements):
                    grad = grad.redistribute(p.device_mesh, p.placements)
                grad = grad.to_local()
            local.grad = grad
        p.grad = None

    return param.register_post_accumulate_grad_hook(move_to_local)
