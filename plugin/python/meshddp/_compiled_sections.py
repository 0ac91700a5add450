"""torch.compile(ddp) under data_parallel_sharding_strategy='optim_grads_params' (ZeRO-3): each compiled section
of the wrapped module gathers the FSDP units it reads, before its forward and again before its backward. Not the
split itself (compile.py) nor the units (grad_buffer/sharded_params.h).

Note [Compiled sections under optim_grads_params]
  Under ZeRO-3 a param is a view of its unit's storage, which holds bytes only while the unit is in use; an eager
  op gathers the unit of a param it reads (the op interception, Note [Sharded parameters],
  grad_buffer/sharded_params.h). A compiled kernel reads the storage without any op, so nothing would gather. But
  torch.compile of the wrapper splits the wrapped module's graph at meshddp's buckets (Note [Compiling through the
  wrapper], compile.py), and units never share a bucket: each section reads the params of the few units whose
  buckets it closes (and tied weights it uses again). So each section's compiled callable is wrapped
  (GatheringSection):
  - forward: just before it runs, the units its tensor inputs live in are used as one op reading them all would
    use them (PythonDdp.open_compiled_section: gathered and waited for, the forward's other units released, the
    next one prefetched), and kept while it runs: its extern kernels (a matmul) still pass the interception, and
    share the section's OpScope so they release none of them. A later section's units, or the forward's end,
    release them.
  - backward: AOT autograd's compiled backward reads the params it saved, again without any op. A pre-hook on the
    autograd node of each of the section's outputs (each runs before the section's compiled backward node) gathers
    the same units again (gather_for_compiled_backward); the existing rule releases a unit once every param of it
    has reported its gradient. An output that is a view of an input has that input's (an earlier) node: its hook
    gathers the units once more there, which then stay until the step; missing a hook instead would let the
    compiled backward read released storage.
  A rank so holds its shards plus about one section's units (and the next one prefetched), as in eager.
  Compile time: Dynamo and AOT autograd trace fake tensors made from the released params (shapes and strides
  only), and torch's section compiler calls each compiled section once on fake tensors: nothing gathers then.
  Refused by the wrapper's forward (refuse_unsupported), each naming the way out: the graph not split
  (torch._dynamo.config.optimize_ddp off, or a torch whose frame converter cannot be cloned: one graph would read
  every unit with none gathered); compiled submodules (per-block compile runs under its own callback, not through
  these sections); an eager forward while compiled code may run (a torch.compile'd function it calls on a param).
"""

import functools
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from meshddp import compile as _compile


class GatheringSection:
    """A compiled section (what the user's backend returned for it) that gathers the units of its inputs before
    it runs and before its backward (see the Note). `wrapper_ref`: a weakref to the DistributedDataParallel."""

    def __init__(self, wrapper_ref, compiled):
        self.wrapper_ref = wrapper_ref
        self.compiled = compiled

    def __call__(self, *args):
        if any(isinstance(a, FakeTensor) for a in args):  # torch's section compiler, at compile time
            return self.compiled(*args)
        wrapper = self.wrapper_ref()
        if wrapper is None:
            raise RuntimeError("meshddp.DistributedDataParallel: a compiled section of a wrapper under "
                               "data_parallel_sharding_strategy='optim_grads_params' ran after the wrapper was dropped; "
                               "its params hold no bytes. Compile the new wrapper (torch.compile(ddp))")
        engine = wrapper._engine
        scope = engine.open_compiled_section([a for a in args if isinstance(a, torch.Tensor)])
        try:
            out = self.compiled(*args)
        finally:
            params = scope.params()
            del scope
        if params:
            _gather_before_backward(engine, params, out)
        return out


def _gather_before_backward(engine, params, outputs):
    """A pre-hook on the autograd node of each output: gathers the units of `params` before the section's
    compiled backward, which runs after (or as) every one of those nodes."""
    hook = functools.partial(_gather_in_backward, engine, params)
    seen = set()
    for t in tree_leaves(outputs):
        node = t.grad_fn if isinstance(t, torch.Tensor) else None
        if node is not None and node not in seen:
            seen.add(node)
            node.register_prehook(hook)


def _gather_in_backward(engine, params, grad_outputs):
    engine.gather_for_compiled_backward(params)


def section_wrapper(wrapper):
    """The function BucketSplitter wraps each compiled section with under optim_grads_params."""
    return functools.partial(GatheringSection, weakref.ref(wrapper))


def _error(what):
    return RuntimeError(f"meshddp.DistributedDataParallel: {what}")


def refuse_unsupported(module, compiling, split):
    """Raises when `module`'s forward would run compiled code that reads released params (see the Note).
    compiling: torch.compile of the wrapper runs it; split: its graph is split at the buckets (sections gather)."""
    if compiling and any(isinstance(p, DTensor) for p in module.parameters()):
        raise _error("torch.compile of the wrapper under data_parallel_sharding_strategy='optim_grads_params' with "
                     "DTensor (torch TP) params is not supported: their graph is not split at the buckets (torch's "
                     "section compiler cannot pass DTensors between sections), and its one compiled graph would read "
                     "every unit's storage with none gathered. Run the model eagerly, or use 'optim_grads' (compiled "
                     "DTensor models work there)")
    if compiling and not split:
        raise _error("torch.compile of the wrapper under data_parallel_sharding_strategy='optim_grads_params' needs "
                     "the compiled graph split at meshddp's buckets (each section gathers the FSDP units it reads), "
                     "but it is not split here (torch._dynamo.config.optimize_ddp is off, or this torch's frame "
                     "converter cannot be cloned): one graph would read every unit with none gathered. Turn "
                     "torch._dynamo.config.optimize_ddp back on (its default; fullgraph=True is fine), run the model "
                     "eagerly, or use 'optim_grads'")
    if _compile.has_compiled_submodules(module):
        raise _error("a compiled submodule (per-block compile: block.compile()) is not supported under "
                     "data_parallel_sharding_strategy='optim_grads_params': its kernels read the params' storage "
                     "directly, outside the sections of torch.compile(ddp) that gather each FSDP unit, and would read "
                     "released (empty) storage. Compile the wrapper instead (torch.compile(ddp) or ddp.compile()), "
                     "or use 'optim_grads'")
    if not compiling and _compile.may_run_compiled_code(module):
        raise _error("an eager forward under data_parallel_sharding_strategy='optim_grads_params' while torch.compile "
                     "has made code in this process: a compiled function the forward calls on a param would read its "
                     "released (empty) storage, without the dispatcher that gathers each FSDP unit on use. Compile "
                     "the wrapper itself (torch.compile(ddp): each compiled section gathers its units), run the model "
                     "eagerly in a process that compiles nothing, or use 'optim_grads'")
