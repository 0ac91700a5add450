"""Pipeline parallel with meshddp as the data-parallel wrapper (docs/guide/pipelines.md): the functions
over all of a rank's chunks (finalize_model_grads, declare_tied_across_stages), for any schedule, and
PipelineStage, a drop-in for torch's, whose submodule is a
meshddp.DistributedDataParallel. torch's stage drives only torch's DDP (through its Reducer) and FSDP2;
any other wrapper gets a plain backward with no sync control, and its scale_grads divides p.grad, which
a flat-buffer DDP's optimizer does not read. This stage overrides those hooks:

- backward_maybe_with_nosync: every backward (full, the input pass and the weight pass of a split
  backward) runs with the chunk's sync held, so gradients only accumulate into the flat buffers and a
  weight's gradient arriving in a later weight pass is counted once.
- the weight pass of a split backward (stage_backward_weight) runs through autograd's AccumulateGrad
  (torch.autograd.backward to the params) instead of torch's `weight.grad += dw`: that add bypasses
  the buffer's hooks, and zero_grad_buffer() leaves a slot whose param got a gradient in the last
  step stale (Note [Slots written in place]) for the step's first gradient to overwrite. A weight pass
  that was a param's first gradient of the step (ScheduleDualPipeV's micro-batch 0 on the last
  stage) was added to the stale slot, then overwritten by the next micro-batch's backward. Each gradient
  goes into its own input of its node (torch sums them into input 0), through the engine directly
  (torch.autograd.backward's shape check cannot read a compiled module's node).
- chunks under data_parallel_sharding_strategy='optim_grads_params' (params gathered per unit on use, Note
  [Split backward under optim_grads_params]).
- compiled stages under a split backward: the input pass keeps the graph of a compiled module's
  output alive for the weight pass (Note [Compiled stages under a split backward]).
- perform_reduce_grad (the schedule's REDUCE_GRAD action, after the chunk's last backward) and
  scale_grads (called by the schedules without that action right after the last backward): the flat
  buffers are scaled (scale_gradients) and the chunk's sync is started (start_grad_sync), overlapping
  the other chunks' backward; both at most once per step.
- _prepare_backward_infra (the schedule's first step): the micro-batch count and grad_reduction must be
  the same on every DP rank of the chunk (an all-gather over its DP group), else every rank raises
  naming them.
- _get_init_p2p_neighbors_ops (the schedule's first step): torch's warm-up send/recv to the neighbour
  stages, without those to this rank itself. V-shaped schedules (ScheduleZBVZeroBubble,
  ScheduleDualPipeV) put stages pp-1 and pp on one rank, and Gloo has no connection from a rank to
  itself (pytorch/gloo#344): torch's own stage fails there with "Pair is not connected". Activations
  between two stages of one rank never use these ops (torch passes them locally).
- scale_grads under schedule.eval() (forward only, yet torch's schedules still call perform_reduce_grad
  or scale_grads): nothing. Scaling then would divide the buffers (a finished step's gradients, kept
  for the optimizer step or for accumulation) and start a sync of them.
- finalize_model_grads(stages) waits for every chunk's sync: call it after schedule.step() and before the
  optimizer step. It is each chunk's DDP finish_grad_sync(), which first starts the sync (scaled) if the
  schedule did not: the DDP's method, DistributedOptimizer.step() and finalize_model_grads give the same
  gradients, and a second call in the same step is a no-op.
- Module buffers (broadcast_buffers) are broadcast once per optimizer step, before its first forward
  (Note [Module buffers once per step], plugin/distributed_data_parallel.cpp), not before each
  micro-batch's: under 1F1B a later forward would write over a buffer an earlier one saved for backward.
- clear_runtime_states (the start of every schedule.step()): gradient accumulation across
  schedule.step() calls (several steps, then one optimizer step, no zero_grad_buffer() between), as with
  torch's DDP in torch's stage, whose every step syncs and adds onto .grad. A sync the previous step
  started is finished first (finalize_model_grads between the steps is optional); the synced gradients are
  set aside (one copy of the chunk's trainable grads) and the buffers zeroed, so that this step scales
  (by its own micro-batch count: torch's stage divides the earlier steps' gradients again) and reduces
  its own gradients only; whatever finishes the sync adds the set-aside gradients back (the DDP keeps
  them), and zero_grad_buffer() drops them (an accumulation discarded). The result is the sum of
  the steps' gradients, as one process backpropagating each step's loss. A step after an optimizer step
  on the gradients with no zero_grad_buffer() after it is refused (the stepped gradients would be added
  to the next step's).

grad_reduction="sum" is for a loss already normalised over the whole batch mesh (torchtitan's
per-token loss: the sum over a micro-batch's valid tokens divided by the global count of valid
tokens, with the schedule's scale_grads=False): the DP reduction is then a sum, as torchtitan's
FSDP with its gradient divide factor set to 1."""

import inspect
import warnings
import weakref

import torch
import torch.distributed as dist
from torch.autograd.graph import GradientEdge, _engine_run_backward
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage
from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc

from meshddp import _C, _deprecated
from meshddp import compile as _compile
from meshddp.ddp import DistributedDataParallel

# Note [torch's stage methods this stage overrides]
#   They are not torch's public API (two are private), so a torch release may rename them or change how
#   the schedules call them, and the override would then be skipped or called wrongly, silently. Each is
#   checked at import against the signature it was written for (torch 2.11; annotations aside): a
#   difference fails the import naming the method. Update the override, then its entry here.
_WRITTEN_FOR = {
    "_get_init_p2p_neighbors_ops": "(self)",
    "_prepare_backward_infra": "(self, num_microbatches)",
    "clear_runtime_states": "(self)",
    "backward_maybe_with_nosync": "(self, backward_type, bwd_kwargs, last_backward=False)",
    "scale_grads": "(self, grad_scale_factor)",
    "perform_reduce_grad": "(self, grad_scale_factor)",
}


def _plain_signature(fn):
    """fn's signature as text, without annotations (a changed type hint changes no call)."""
    sig = inspect.signature(fn)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def _check_torch_stage(base=_TorchPipelineStage):
    """Raises ImportError naming the first method of torch's PipelineStage (`base`) that this stage
    overrides and that is missing or has another signature than the one it was written for."""
    for name, expected in _WRITTEN_FOR.items():
        fn = getattr(base, name, None)
        got = "missing" if not callable(fn) else f"{name}{_plain_signature(fn)}"
        if got != f"{name}{expected}":
            raise ImportError(
                f"meshddp.pipelining: torch {torch.__version__}'s PipelineStage.{name} is {got}, but meshddp's "
                f"stage overrides it as written for {name}{expected} (torch 2.11): torch's schedules would skip "
                f"the override or call it with other arguments, and the stage's gradients would be silently wrong. "
                f"Use a torch whose PipelineStage matches (2.11), or update meshddp.pipelining's override "
                f"(Note [torch's stage methods this stage overrides])")
    got = _plain_signature(_get_grad_fn_or_grad_acc)
    if got != "(t)":  # the weight pass (_backward_weight) maps each param to its autograd node with it
        raise ImportError(
            f"meshddp.pipelining: torch {torch.__version__}'s torch.distributed.pipelining._backward."
            f"_get_grad_fn_or_grad_acc is _get_grad_fn_or_grad_acc{got}, but meshddp's stage calls it as "
            f"_get_grad_fn_or_grad_acc(t) (torch 2.11). Use a torch whose pipelining matches (2.11), or update "
            f"meshddp.pipelining (Note [torch's stage methods this stage overrides])")
    got = _plain_signature(_engine_run_backward)
    if got != "(t_outputs, *args, **kwargs)":  # the weight pass runs the engine as torch.autograd.backward does
        raise ImportError(
            f"meshddp.pipelining: torch {torch.__version__}'s torch.autograd.graph._engine_run_backward is "
            f"_engine_run_backward{got}, but meshddp's stage calls it as torch.autograd.backward does in torch 2.11 "
            f"(edges, grads, retain_graph, create_graph, inputs, allow_unreachable=, accumulate_grad=). Use a torch "
            f"whose autograd matches (2.11), or update meshddp.pipelining (Note [torch's stage methods this stage "
            f"overrides])")


_check_torch_stage()


def _error(what):
    return RuntimeError(f"meshddp.pipelining.{what}")


# Note [Split backward under optim_grads_params]
#   A param of a chunk under data_parallel_sharding_strategy='optim_grads_params' is a view of its FSDP unit's
#   storage, which holds no bytes between the unit's uses (Note [Sharded parameters], grad_buffer/sharded_params.h).
#   torch's split backward maps each param to its AccumulateGrad node through t.view_as(t) outside backward: the
#   param mode takes view_as's second argument as a read of sizes only (param_gather.cpp), so nothing is gathered
#   or refused there. The units themselves follow backward's gather-on-use: the input pass gathers the units it
#   reads (every DP rank of the chunk runs the same schedule: the same gathers in the same order); a unit stays
#   gathered until each of its params has reported its gradient, i.e. until the weight pass; a forward of the same
#   chunk in between releases it, and the weight pass gathers it again if it reads it. The optimizer step releases
#   every unit.


class PipelineStage(_TorchPipelineStage):
    """torch.distributed.pipelining.PipelineStage (same arguments) whose `submodule` is a
    meshddp.DistributedDataParallel. Per step: zero each chunk's buffer (submod.zero_grad_buffer()),
    schedule.step(...), meshddp.pipelining.finalize_model_grads(stages), optimizer.step().
    grad_reduction: "mean" (default: the buffers averaged over the chunk's DP group, as every meshddp
    DDP) or "sum" (a loss already divided by the global token count; see the module's docstring)."""

    def __init__(self, submodule, *args, grad_reduction="mean", **kwargs):
        if isinstance(getattr(submodule, "_orig_mod", None), DistributedDataParallel):
            raise _error(f"PipelineStage: submodule is torch.compile(ddp), a {type(submodule).__name__} around the "
                         f"meshddp.DistributedDataParallel; compile the wrapper in place instead, ddp.compile() (it "
                         f"stays the DistributedDataParallel the stage drives), or compile each block "
                         f"(docs/guide/compile.md)")
        if not isinstance(submodule, DistributedDataParallel):
            raise _error(f"PipelineStage: submodule must be a meshddp.DistributedDataParallel "
                         f"(wrap the stage's module first), got {type(submodule).__name__}; for a module without "
                         f"meshddp use torch.distributed.pipelining.PipelineStage")
        if grad_reduction not in ("mean", "sum"):
            raise _error(f"PipelineStage: grad_reduction must be 'mean' or 'sum', got {grad_reduction!r}")
        super().__init__(submodule, *args, **kwargs)
        # The stages this rank holds (interleaved and V-shaped schedules: num_stages / pp): a gradient
        # norm or an optimizer step over fewer of them is refused (docs/guide/pipelines.md, "One run across stages").
        pp_size = dist.get_world_size(self.group)
        _C._declare_pipeline_chunks(submodule._engine, max(1, self.num_stages // pp_size))
        if pp_size > 1 and submodule._pipeline_group is None:
            warnings.warn(
                f"meshddp.pipelining.PipelineStage {self.stage_index}: its DistributedDataParallel was built without "
                f"a 'pp' mesh dim (process_group=, or a mesh of the stage only), so its gradient norm, clipping and "
                f"non-finite skip cover this stage alone, not the {pp_size}-stage pipeline; build it from the whole "
                f"mesh, e.g. DistributedDataParallel(module, mesh, dp_dim='dp') with mesh dims ('dp', 'pp')",
                UserWarning, stacklevel=2)
        self._sync_started = False  # this schedule.step()'s buffers scaled and their sync started
        self._backward_ran = False  # a backward of this schedule.step() (none under schedule.eval())
        # Whatever finishes the chunk's sync (this stage, the DDP's finish_grad_sync, DistributedOptimizer.step,
        # finalize_model_grads) first starts it here, scaled, if the schedule did not.
        submodule._before_finish = weakref.WeakMethod(self._start_sync_if_not_started)
        # "sum": the buffers times the DP size before the sync, whose buckets divide by it.
        self._grad_reduction = grad_reduction
        self._dp_factor = dist.get_world_size(submodule._dp_group) if grad_reduction == "sum" else 1

    def _get_init_p2p_neighbors_ops(self):
        """torch's, less the ops whose peer is this rank (see the module's docstring)."""
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]

    def _prepare_backward_infra(self, num_microbatches):
        """torch's (once, at the schedule's first step), then the micro-batch count agreed over the chunk's
        DP group: a rank scaling by another count would silently train on other gradients."""
        super()._prepare_backward_infra(num_microbatches)
        group = self.submod._dp_group
        mine = torch.tensor([int(num_microbatches), int(self._grad_reduction == "sum")], dtype=torch.int64,
                            device=self.device)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        ranks = dist.get_process_group_ranks(group)
        counts = [int(c[0].item()) for c in gathered]
        if len(set(counts)) > 1:
            per_rank = ", ".join(f"rank {r}: {c}" for r, c in zip(ranks, counts))
            raise _error(f"PipelineStage {self.stage_index}: the schedule's micro-batch count (n_microbatches) "
                         f"differs across the stage's DP ranks ({per_rank}); every DP rank must split its batch "
                         f"into the same number of micro-batches (the gradients are scaled and reduced per step)")
        kinds = ["sum" if c[1].item() else "mean" for c in gathered]
        if len(set(kinds)) > 1:
            per_rank = ", ".join(f"rank {r}: '{k}'" for r, k in zip(ranks, kinds))
            raise _error(f"PipelineStage {self.stage_index}: grad_reduction differs across the stage's DP ranks "
                         f"({per_rank}); give every rank's PipelineStage the same grad_reduction (the DP reduction "
                         f"would mix sums and means silently)")

    def clear_runtime_states(self):
        """torch's per-step reset (schedule.step() calls it first): this step's sync not started yet. A
        sync of the previous step still in flight is caught by the DDP's forward check."""
        super().clear_runtime_states()
        # The previous step's sync, never finished (its optimizer step not taken yet): accumulation, or an
        # eval() between the steps (forward only: the synced gradients wait for the next training step).
        if self._sync_started and self.submod._engine.sync_pending():
            self.finish_grad_sync()
        if self.has_backward:
            self._resume_accumulation()
        self._sync_started = False
        self._backward_ran = False

    def _resume_accumulation(self):
        """A step whose buffers hold an earlier step's synced gradients (no zero_grad_buffer() since): sets
        them aside and zeroes the buffers (see the module's docstring), or refuses when an optimizer stepped
        on them (its step, then no zero_grad_buffer())."""
        ddp = self.submod
        if ddp._grads_state == "zeroed":
            return
        if ddp._grads_state == "stepped":
            raise _error(f"PipelineStage {self.stage_index}: schedule.step() after an optimizer step without "
                         f"zero_grad_buffer(): the gradient buffers of this stage's DistributedDataParallel still hold "
                         f"the gradients the optimizer stepped on, and this step would add to them. Call "
                         f"submod.zero_grad_buffer() on every chunk before each optimizer step's first schedule.step() "
                         f"(several schedule.step() calls before one optimizer step accumulate)")
        if ddp._shards_grads:
            raise _error(f"PipelineStage {self.stage_index}: schedule.step() again before the optimizer step, on "
                         f"gradients already synced, under data_parallel_sharding_strategy='{ddp._strategy}': that "
                         f"keeps only this rank's shard of each gradient, so the synced gradients cannot be set aside "
                         f"and added back. Give one schedule.step() all of the optimizer step's micro-batches "
                         f"(n_microbatches), or use data_parallel_sharding_strategy='optim' to accumulate across "
                         f"schedule.step() calls")
        set_aside = [(n, ddp.main_grad(n).clone()) for n, p in ddp.module.named_parameters() if p.requires_grad]
        broadcast_due = ddp._engine.buffers_broadcast_due()  # once per optimizer step, not per schedule.step()
        ddp.zero_grad_buffer()
        ddp._engine.set_buffers_broadcast_due(broadcast_due)
        ddp._set_aside = set_aside  # added back by whatever finishes this step's sync (ddp._after_grad_sync)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        ddp = self.submod
        if self._sync_started:
            raise _error(f"PipelineStage {self.stage_index}: a backward after its chunk's gradient sync was started "
                         f"(REDUCE_GRAD ran before this step's last backward); call "
                         f"meshddp.pipelining.finalize_model_grads(stages) and zero_grad_buffer() between steps")
        ddp.set_requires_gradient_sync(False)
        self._backward_ran = True
        try:
            if backward_type == "weight":
                return self._backward_weight(bwd_kwargs["param_groups"]), None
            roots = self._graph_roots(bwd_kwargs["stage_output"]) if backward_type == "input" else []
            # torch's base with a non-torch-DDP submod: a plain backward (stage_backward, or the split
            # stage_backward_input); the held sync makes it accumulate only.
            grads, param_groups = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=False)
            for group in (param_groups or ()) if roots else ():
                group["graph_roots"] = roots  # dropped by the weight pass, with the intermediates
            return grads, param_groups
        finally:
            ddp.set_requires_gradient_sync(True)

    def _graph_roots(self, stage_output):
        """Note [Compiled stages under a split backward]: torch's input pass (stage_backward_input) detaches
        the stage's outputs, so that the autograd nodes above the ones the weight pass starts from (its
        intermediates) are freed, and keeps each intermediate alive by its Python object. A compiled module's
        node is an autograd.Function's, whose Python object does not keep it alive: it was freed with the
        outputs, and the weight pass found no graph ("element 0 of tensors does not require grad"). When the
        stage may run compiled code, an alias of each output (a view, whose node holds the output's node)
        keeps the graph until the weight pass, with the saved tensors of the nodes above the intermediates
        (none for a stage whose last module is compiled: its node is the intermediate)."""
        ddp = self.submod
        if getattr(ddp, "_compiled_call_impl", None) is None and not _compile.has_compiled_submodules(ddp.module):
            return []
        outputs = stage_output if isinstance(stage_output, (list, tuple)) else [stage_output]
        return [t.view_as(t) for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]

    def _backward_weight(self, param_groups):
        """torch's stage_backward_weight (the weight pass from the intermediates that the input pass saved),
        the gradients accumulated by autograd into the params, so that the buffer's hooks place them (see
        the module's docstring). Returns None for each param, as torch's callers ignore the result."""
        params = list(self.submod.parameters())
        by_node = {_get_grad_fn_or_grad_acc(p): p for p in params}
        for group in param_groups:
            edges, grads = [], []
            # Popped: the saved intermediates and their gradients are freed after use, as in torch's.
            roots = group.pop("graph_roots", None)  # Note [Compiled stages under a split backward]: kept for this pass
            for grads_tuple, intermediate in zip(group.pop("grads", ()), group.pop("intermediates")):
                # Each gradient into its own input of the node: a compiled section (one autograd node
                # for the whole section) may take several (torch's sums them all into input 0).
                for i, grad in enumerate(grads_tuple):
                    if grad is not None:
                        edges.append(GradientEdge(intermediate, i))
                        grads.append(grad)
            if edges:
                # The engine itself, as torch.autograd.backward calls it after its shape check, which reads
                # node._input_metadata: a compiled module's node (an autograd.Function's) has none to read
                # (Note [torch's stage methods this stage overrides]).
                _engine_run_backward(tuple(edges), tuple(grads), False, False,
                                     tuple(by_node[n] for n in group["params"]), allow_unreachable=True,
                                     accumulate_grad=True)
            del roots
        return tuple(None for _ in params)

    def scale_grads(self, grad_scale_factor):
        """Divides the chunk's flat gradient buffers by `grad_scale_factor` (the micro-batch count with
        the schedule's scale_grads=True, else 1; with grad_reduction="sum" also multiplies them by the DP
        size), then starts the chunk's sync (once per step)."""
        if self._sync_started:
            return  # the schedule's REDUCE_GRAD already scaled and started this chunk
        if not self._backward_ran:
            return  # schedule.eval(): torch's schedules reduce after a forward-only step too; nothing to scale
        factor = self._dp_factor / grad_scale_factor
        if factor != 1:
            self.submod.scale_gradients(factor)
        self.submod.start_grad_sync()
        self._sync_started = True

    def perform_reduce_grad(self, grad_scale_factor):
        self.scale_grads(grad_scale_factor)

    def _start_sync_if_not_started(self):
        """Before the chunk's sync is finished: this step's buffers scaled and the sync started, once,
        if a backward ran and the schedule did not (scale_grads(1): with grad_reduction="sum" the DP factor)."""
        self.scale_grads(1)

    def finish_grad_sync(self):
        """Waits for this chunk's sync (starting it first if the schedule never did), then adds back the
        gradients of the optimizer step's earlier schedule.step() calls: the DDP's finish_grad_sync, the same
        gradients whichever is called. A second call in the same step is a no-op."""
        self.submod.finish_grad_sync()


def finalize_model_grads(chunks, num_tokens=None, pp_group=None):
    """Finishes the gradient sync of every chunk this rank holds, after the step's last backward (or
    schedule.step()) and before the optimizer step. `chunks`: this rank's PipelineStages (one or a
    list; each stage's sync, as its finish_grad_sync()), or its meshddp.DistributedDataParallel chunks
    in chunk order 0..V-1 (DdpConfig.virtual_pipeline_chunk), the sum of weights tied across stages
    included. num_tokens (DDP chunks only; int or one-element tensor): this rank's count of valid
    tokens, the loss being a sum over them: the buffers are then divided by the global count (summed
    over the DP group; with pp_group, the count of its last rank, the stage that computes the loss).
    Returns that count (-1 without num_tokens)."""
    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    if chunks and all(isinstance(c, PipelineStage) for c in chunks):
        if num_tokens is not None:
            raise _error("finalize_model_grads: num_tokens is for DistributedDataParallel chunks; with "
                         "PipelineStages normalise the loss by the global token count yourself and build the "
                         "stages with grad_reduction=\"sum\"")
        for stage in chunks:
            stage.finish_grad_sync()
        return -1
    for c in chunks:
        if not isinstance(c, DistributedDataParallel):
            raise _error(f"finalize_model_grads: expected this rank's meshddp.DistributedDataParallel chunks or "
                         f"its meshddp.pipelining.PipelineStages (not a mix), got {type(c).__name__}")
    for c in chunks:  # a PipelineStage's sync, scaled, if its schedule did not start it
        before = c._before_finish() if c._before_finish is not None else None
        if before is not None:
            before()
    count = _C.finalize_model_grads([c._engine for c in chunks], _token_count(num_tokens), pp_group)
    for c in chunks:
        c._after_grad_sync()  # synced (and scaled) by meshddp: what DistributedOptimizer.step() may read
    return count


def _token_count(num_tokens):
    """num_tokens as an int (a Python number or a one-element tensor, as torchtitan counts it); a count
    that is not a whole number is refused rather than truncated."""
    if num_tokens is None:
        return None
    value = num_tokens.item() if hasattr(num_tokens, "item") else num_tokens
    if isinstance(value, bool) or float(value) != int(value):
        raise ValueError(f"finalize_model_grads: num_tokens = {num_tokens!r} is not a whole number of tokens; pass "
                         "this rank's count of valid (loss-bearing) tokens, e.g. (labels != ignore_index).sum()")
    return int(value)


def declare_tied_across_stages(param):
    """Declares `param` one copy of a weight tied across pipeline stages (the embedding on the first
    stage, the LM head on the last; declare each on its own stage before wrapping its chunk)."""
    _C.declare_tied_across_stages(param)


def finish_grad_sync(stages):
    """Deprecated: finalize_model_grads(stages), the same call (an empty list here finishes nothing)."""
    _deprecated.warn("meshddp.pipelining.finish_grad_sync", "meshddp.pipelining.finalize_model_grads")
    for stage in stages if isinstance(stages, (list, tuple)) else [stages]:
        if not isinstance(stage, PipelineStage):
            raise _error(f"finish_grad_sync: expected meshddp.pipelining.PipelineStage, got {type(stage).__name__}")
        stage.finish_grad_sync()
