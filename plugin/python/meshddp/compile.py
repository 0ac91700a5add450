"""torch.compile of a meshddp.DistributedDataParallel (docs/guide/compile.md): the compiled graph is
split at meshddp's own bucket boundaries, as Dynamo's DDPOptimizer splits it for torch's DDP, so that
each section's backward ends by filling whole buckets whose launches overlap the next section's
backward. Not the place for the hooks or the buckets themselves: those are the C++ engine's, unchanged.

How it is wired (Note [Compiling through the wrapper]):
- DistributedDataParallel.forward is skipped by Dynamo but the frames it calls are not
  (torch.compiler.disable(recursive=False)): its checks, the param-gather waits (ZeRO-1) and the
  forward scope run eagerly, adding no graph break, and the wrapped module's forward is what Dynamo
  traces.
- While torch.compile's callback is active and torch._dynamo.config.optimize_ddp is on (its default,
  the switch torch's DDP honours too), the wrapped module runs under a clone of that callback whose
  backend is BucketSplitter around the user's backend: the same move torch makes for its own DDP in
  convert_frame.py (CatchErrorsWrapper.__call__ with _get_active_ddp_module), keyed here on meshddp's
  layout (`_Ddp._param_buckets`: each param's bucket in launch order) instead of a byte count.
- Each section is compiled by the user's backend through torch's DDPOptimizer machinery
  (SubmodCompiler, which fakifies inputs and keeps AOT metadata per section).
- Under data_parallel_sharding_strategy='optim_grads_params' each compiled section's callable is wrapped so
  that it gathers the FSDP units it reads, before its forward and its backward (Note [Compiled sections
  under optim_grads_params], meshddp/_compiled_sections.py).

Private torch internals used here are checked at import against what this file was written for
(torch 2.11): a difference fails the import naming them, as meshddp.pipelining does for PipelineStage.
"""

import inspect
import warnings
import weakref

import torch
from torch import fx
from torch._C._dynamo import eval_frame as _eval_frame
from torch._dynamo import convert_frame as _convert_frame
from torch._dynamo import utils as _dynamo_utils
from torch._dynamo.backends import distributed as _ddp_optimizer
from torch._dynamo.output_graph import GraphCompileReason
from torch.distributed.tensor import DTensor

# Note [torch internals the compiled split uses]
#   None of these is torch's public API. Each is checked at import: a callable against the signature it
#   was written for (annotations aside), an attribute by its presence. When one fails, read the torch
#   source it names, adapt this file, then its entry here.
_WRITTEN_FOR = {
    "torch._C._dynamo.eval_frame.get_eval_frame_callback": (_eval_frame, "get_eval_frame_callback", None),
    "torch._C._dynamo.eval_frame.set_eval_frame": (_eval_frame, "set_eval_frame", None),
    "torch._dynamo.convert_frame.CatchErrorsWrapper": (_convert_frame, "CatchErrorsWrapper", "(self, callback, hooks)"),
    "torch._dynamo.convert_frame.catch_errors_wrapper": (_convert_frame, "catch_errors_wrapper", "(callback, hooks)"),
    "torch._dynamo.convert_frame.ConvertFrame._clone_with_backend": (_convert_frame.ConvertFrame, "_clone_with_backend",
                                                                    None),
    "torch._dynamo.convert_frame.ConvertFrameAssert._clone_with_backend": (_convert_frame.ConvertFrameAssert,
                                                                          "_clone_with_backend", None),
    "torch._dynamo.utils.get_optimize_ddp_mode": (_dynamo_utils, "get_optimize_ddp_mode", "()"),
    "torch._dynamo.backends.distributed.SubmodCompiler": (_ddp_optimizer, "SubmodCompiler",
                                                          "(self, module, compiler, fake_mode)"),
    "torch._dynamo.backends.distributed.propagate_dynamo_source": (_ddp_optimizer, "propagate_dynamo_source",
                                                                   "(orig_gm, split_gm)"),
    "torch._dynamo.backends.distributed.propagate_metadata": (_ddp_optimizer, "propagate_metadata",
                                                              "(orig_gm, split_gm)"),
    "torch._dynamo.convert_frame.output_codes.seen_ids": (_convert_frame.output_codes, "seen_ids", None),
}


def _check_torch_internals(written_for=None):
    """Raises ImportError naming the first entry of `written_for` (default _WRITTEN_FOR) that the running
    torch lacks or has with another signature."""
    for where, (owner, name, signature) in (written_for or _WRITTEN_FOR).items():
        thing = getattr(owner, name, None)
        if thing is None:
            raise ImportError(f"meshddp.compile: torch {torch.__version__} has no {where}, which meshddp's split of a "
                              f"compiled graph at its bucket boundaries uses (Note [torch internals the compiled split "
                              f"uses], meshddp/compile.py); update meshddp for this torch")
        if signature is None:
            continue
        target = thing.__init__ if inspect.isclass(thing) else thing
        got = str(inspect.signature(target).replace(
            parameters=[p.replace(annotation=inspect.Parameter.empty) for p in inspect.signature(target).parameters.values()],
            return_annotation=inspect.Signature.empty))
        if got != signature:
            raise ImportError(f"meshddp.compile: {where} in torch {torch.__version__} has the signature {got}, but "
                              f"meshddp was written for {signature} (Note [torch internals the compiled split uses], "
                              f"meshddp/compile.py); update meshddp for this torch")


_check_torch_internals()

SPLIT_REASON = "meshddp bucket split: a graph section ends where a bucket fills (torch._dynamo.config.optimize_ddp=False disables)"


class BucketSplitter:
    """A Dynamo backend that cuts a traced forward graph where meshddp's buckets fill in backward and
    compiles each section with `backend` (the user's). `param_bucket`: id(param) -> the global index
    of its bucket (launch order), for the wrapped module's trainable params. `wrap_section`: applied to
    each compiled section's callable, or None (under optim_grads_params it gathers the section's units:
    meshddp/_compiled_sections.py)."""

    def __init__(self, backend, param_bucket, wrap_section=None):
        self.backend = backend
        self.param_bucket = param_bucket
        self.wrap_section = wrap_section or (lambda compiled: compiled)
        self.sections = []  # per compiled graph: how many sections it was cut into
        self.warned_dtensor = False

    def sections_of(self, gm, example_inputs):
        """Each non-placeholder, non-output node's section (0 = first in forward)."""
        nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
        order = {n: i for i, n in enumerate(nodes)}
        bucket_of_input = {}
        for node, value in zip([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs):
            bucket = self.param_bucket.get(id(value))
            if bucket is not None:
                bucket_of_input[node] = bucket
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                bucket = self.param_bucket.get(id(getattr(gm, node.target, None)))
                if bucket is not None:
                    bucket_of_input[node] = bucket
        # A param's gradient is whole after the backward of its first use in forward (tied weights
        # are used more than once); a get_attr param is its own first use.
        completes = {}  # node -> buckets of the params whose gradient that node's backward completes
        remaining = {}
        for param_node, bucket in bucket_of_input.items():
            users = [u for u in param_node.users if u in order]
            first = param_node if param_node.op == "get_attr" else (min(users, key=order.get) if users else None)
            if first is None:
                continue
            completes.setdefault(first, []).append(bucket)
            remaining[bucket] = remaining.get(bucket, 0) + 1
        present = sorted(remaining)
        launchable = 0  # buckets of `present`, in launch order, whose every param got its gradient
        sections = [[]]  # built backwards: sections[0] is the last in forward
        members = set()
        split_due = False
        for node in reversed(nodes):
            if split_due and sections[-1] and _has_outside_user(sections[-1], members):
                sections.append([])
                members = set()
                split_due = False
            sections[-1].append(node)
            members.add(node)
            for bucket in completes.get(node, ()):
                remaining[bucket] -= 1
            advanced = launchable
            while advanced < len(present) and remaining[present[advanced]] == 0:
                advanced += 1
            if advanced > launchable:
                launchable = advanced
                split_due = True
        if len(sections) > 1 and not any(n in completes for n in sections[-1]):
            sections[-2].extend(sections.pop())  # a preamble without params: joined to the next section
        sections.reverse()
        return {node: i for i, section in enumerate(sections) for node in section}, len(sections)

    def __call__(self, gm, example_inputs):
        if any(isinstance(t, DTensor) for t in example_inputs):
            # torch's section compiler fails on DTensors passed between sections ("got mixed torch.Tensor and
            # DTensor" while fakifying them); one graph is exact, without the overlap.
            if not self.warned_dtensor:
                self.warned_dtensor = True
                warnings.warn("meshddp: the compiled graph has DTensor inputs (torch tensor parallelism), so it is "
                              "not split at meshddp's buckets and their reductions start after the whole compiled "
                              "backward; compile each block instead (block.compile()) to keep them overlapped "
                              "(docs/guide/compile.md)", stacklevel=2)
            self.sections.append(1)
            return self.wrap_section(self.backend(gm, example_inputs))
        section_of, count = self.sections_of(gm, example_inputs)
        self.sections.append(count)
        if count == 1:
            return self.wrap_section(self.backend(gm, example_inputs))
        split_gm = fx.passes.split_module.split_module(gm, None, lambda node: section_of[node])
        _ddp_optimizer.propagate_dynamo_source(gm, split_gm)
        _ddp_optimizer.propagate_metadata(gm, split_gm)
        fake_mode = _dynamo_utils.detect_fake_mode(example_inputs)
        if fake_mode is None:
            fake_mode = torch._subclasses.fake_tensor.FakeTensorMode()
        compiler = _SectionCompiler(split_gm, self.backend, fake_mode, self.wrap_section)
        with _dynamo_utils._disable_saved_tensors_hooks_during_tracing():
            compiler.run(*example_inputs)
        split_gm.recompile()
        return split_gm


def _has_outside_user(section, members):
    """Whether a node of the section is used after it (else cutting here would leave it dead)."""
    return any(user not in members for node in section for user in node.users)


class _SectionCompiler(_ddp_optimizer.SubmodCompiler):
    """torch's DDPOptimizer section compiler, handing each section to the backend with meshddp's reason
    on it (torch._dynamo.explain lists it among the break reasons)."""

    def __init__(self, module, backend, fake_mode, wrap_section):
        def compile_section(section, example_inputs):
            section.compile_subgraph_reason = GraphCompileReason(SPLIT_REASON, [])
            return wrap_section(backend(section, example_inputs))

        super().__init__(module, compile_section, fake_mode)


# -- the wrapper's forward under torch.compile -------------------------------------------------------
_split_callbacks = weakref.WeakKeyDictionary()  # the user's callback -> {wrapper id: (wrapper ref, clone, splitter)}

# torch.compile's callback for the frames about to run: a CatchErrorsWrapper while compiling, None or
# False (run only what is compiled) otherwise. A builtin, so calling it adds no frame for Dynamo to see.
current_callback = _eval_frame.get_eval_frame_callback


def is_compiling_callback(callback):
    return isinstance(callback, _convert_frame.CatchErrorsWrapper)


def split_callback(wrapper, callback, wrap_section=None):
    """The callback to run the wrapped module under: a clone of torch.compile's `callback` whose backend
    splits the graph at `wrapper`'s buckets (one per pair, kept: Dynamo guards compiled code on its
    backend, so a new clone per step would recompile), or `callback` itself when optimize_ddp is off, it
    is not compiling, or it cannot clone itself. wrap_section: BucketSplitter's."""
    if not is_compiling_callback(callback) or _dynamo_utils.get_optimize_ddp_mode() != "ddp_optimizer":
        return callback
    convert = callback._torchdynamo_orig_backend
    backend = getattr(convert, "_torchdynamo_orig_backend", None)
    if backend is None or not hasattr(convert, "_clone_with_backend"):
        warnings.warn(f"meshddp: torch.compile's frame converter ({type(convert).__name__}) has no "
                      f"_torchdynamo_orig_backend or _clone_with_backend, so the compiled graph is not split at "
                      f"meshddp's buckets and their reductions start after the whole backward (Note [torch internals "
                      f"the compiled split uses], meshddp/compile.py)", stacklevel=3)
        return callback
    clones = _split_callbacks.setdefault(callback, {})
    entry = clones.get(id(wrapper))
    if entry is None or entry[0]() is not wrapper:
        splitter = BucketSplitter(backend, wrapper._param_buckets(), wrap_section)
        clone = _convert_frame.catch_errors_wrapper(convert._clone_with_backend(splitter), callback.hooks)
        entry = clones[id(wrapper)] = (weakref.ref(wrapper), clone, splitter)
    return entry[1]


def call_with_callback(module, args, kwargs, callback):
    """module(*args, **kwargs) with `callback` as Dynamo's callback for the frames it runs (None: eagerly)."""
    prior = _eval_frame.set_eval_frame(callback)
    try:
        return module(*args, **kwargs)
    finally:
        _eval_frame.set_eval_frame(prior)


def has_compiled_submodules(module):
    """Whether a submodule of `module` was compiled (module.compile(), or a torch.compile'd module put in
    its place): its forward runs compiled kernels, which read params without meshddp's per-op waits."""
    return any(getattr(m, "_compiled_call_impl", None) is not None or isinstance(m, torch._dynamo.eval_frame.OptimizedModule)
               for m in module.modules())


def may_run_compiled_code(module):
    """Whether `module`'s forward may run compiled kernels, which read params without meshddp's per-op
    waits: a compiled submodule, or any code torch.compile has made in this process and not yet freed (a
    compiled function the forward calls on a param, e.g. torch.compile(fn), which only running the forward
    could tell)."""
    return bool(_convert_frame.output_codes.seen_ids) or has_compiled_submodules(module)


def refuse_compiled_autograd(compiling):
    """Compiled autograd captures the whole backward as one graph: meshddp's buckets, launched by C++ hooks
    as gradients arrive, could only launch after it (torch's DDP needs its Python reducer there). Refused
    when its context is on, or its config while torch.compile runs the forward."""
    from torch._dynamo import compiled_autograd

    if (compiling and torch._dynamo.config.compiled_autograd) or compiled_autograd.compiled_autograd_enabled:
        what = "torch.compile of the wrapper" if compiling else "a forward"
        raise RuntimeError(
            f"meshddp.DistributedDataParallel: {what} under compiled autograd (torch._dynamo.config.compiled_autograd "
            f"or torch._dynamo.compiled_autograd.enable) is not supported: it captures the whole backward as one "
            f"graph, which leaves no point inside it for meshddp's bucket reductions (launched by C++ hooks as "
            f"gradients arrive) to start. Turn compiled autograd off: torch.compile(ddp) then splits the graph "
            f"at meshddp's buckets, or compile per block (block.compile() for each transformer block), which keeps "
            f"the bucket reductions overlapped with backward (docs/guide/compile.md)")
