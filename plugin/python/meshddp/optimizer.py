"""meshddp.DistributedOptimizer: the ZeRO-1 optimizer (C++) over a meshddp.DistributedDataParallel
built with DdpConfig(use_distributed_optimizer=True): each DP rank keeps fp32 master weights and
AdamW/SGD state for its 1/DP shard of every bucket; step() updates them and all-gathers params.

It is a torch.optim.Optimizer to torch's LR schedulers: `param_groups` holds one dict per param group
of the C++ optimizer (0: the default, then one per OptimizerConfig.groups rule, in order), each with
its "params", "param_names", "lr" and "weight_decay"; step() reads each group's "lr" and
"weight_decay" (Note [Param groups are the source of the LR]), agreed across the ranks at every step."""

import math
import os
import warnings
import weakref

import torch

from meshddp import _C, _state_dict
from meshddp.ddp import DistributedDataParallel


def _finish_pending_gathers(impl):
    try:
        impl.finish_param_sync()
    except Exception as e:  # noqa: BLE001 (at teardown: say it, do not raise into the interpreter's exit)
        warnings.warn(f"meshddp.DistributedOptimizer: the param all-gathers pending at teardown failed: {e}")


# Note [Param groups are the source of the LR]
#   A torch LR scheduler writes param_groups[g]["lr"]; meshddp's own calls (set_lr, set_group_lr,
#   set_weight_decay, load_state_dict, load_checkpoint) change the C++ optimizer's groups. So the
#   dicts are pushed into the C++ groups before anything that reads or changes them there (step(),
#   state_dict(), set_*), and pulled back after anything that changed them there: whichever side was
#   written last wins, and the dicts always show what the next step() uses.


# Options of torch's optimizers that meshddp's step() does not have: refused when set (truthy) in a group.
_TORCH_ONLY_OPTIONS = ("dampening", "nesterov", "amsgrad", "maximize")


def _muon_weights_of(module, by_name, muon_names, types):
    """{name: module type name} for the params Muon takes (`muon_names`) that are the weight of one of
    `module`'s submodules of `types`."""
    owners = {id(m.weight): type(m).__name__ for m in module.modules()
              if isinstance(m, types) and isinstance(m.weight, torch.nn.Parameter)}
    return {name: owners[id(by_name[name])] for name in muon_names if id(by_name[name]) in owners}


def _adamw_params_adding(patterns, caught):
    """muon_adamw_params with the names `caught` added: the fix a warning gives."""
    return (patterns + ',' + ','.join(caught)).lstrip(',')


def _warn_of_muon_embeddings(module, by_name, muon_names, patterns):
    """Muon orthogonalizes an embedding table whole, moving the rows of tokens not in the batch too;
    Muon's authors (and torch.optim.Muon's docs) keep embeddings on AdamW. muon_adamw_params catches
    them by name ("*embed*"), which misses e.g. GPT-2's "wte": warn, naming the param and the fix."""
    caught = list(_muon_weights_of(module, by_name, muon_names, torch.nn.Embedding))
    if caught:
        warnings.warn(
            f"meshddp.DistributedOptimizer: kind='muon' updates the nn.Embedding weight(s) {caught} with Muon: their "
            f"names match none of muon_adamw_params ({patterns!r}). Embeddings belong on AdamW: add them, e.g. "
            f"muon_adamw_params={_adamw_params_adding(patterns, caught)!r}", UserWarning, stacklevel=3)


def _warn_of_muon_conv_stacks(module, by_name, muon_names, patterns):
    """muon_stacked_matrices takes every 3-D param muon_adamw_params does not name as a stack of matrices
    [E, m, n]; an nn.Conv1d kernel [out, in, k] is 3-D too, and would be stepped as `out` separate in x k
    matrices: warn, naming the param and the fix (docs/reference/optimizer.md "Muon on stacked matrices")."""
    caught = _muon_weights_of(module, by_name, muon_names, torch.nn.modules.conv._ConvNd)
    if caught:
        shapes = ", ".join(f"'{n}' ({kind}, {list(by_name[n].shape)})" for n, kind in caught.items())
        warnings.warn(
            f"meshddp.DistributedOptimizer: kind='muon' with muon_stacked_matrices=True steps the convolution "
            f"kernel(s) {shapes} as stacks of matrices [out][in x k], each orthogonalized by itself: their names "
            f"match none of muon_adamw_params ({patterns!r}). Stacked Muon is for grouped experts [E, m, n]; keep "
            f"kernels on AdamW: muon_adamw_params={_adamw_params_adding(patterns, caught)!r}",
            UserWarning, stacklevel=3)


def _as_float(value):
    """A param group's value as a float for the cross-rank comparison (NaN when it is no number)."""
    value = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


class DistributedOptimizer(torch.optim.Optimizer):
    # step() calls finish_grad_sync() itself: the guard on torch optimizers' steps (meshddp/_guards.py)
    # lets it through.
    _finishes_grad_sync = True
    # torch.amp.GradScaler hands itself to step() (grad_scaler=) instead of checking the gradients for infs
    # itself: each rank's .grad holds the reduced gradient of its own ZeRO-1 shard only, so the ranks'
    # checks could disagree and one rank skip the step (a collective) while the others take it: a hang.
    _step_supports_amp_scaling = True

    def __init__(self, ddp, config=None):
        if not isinstance(ddp, DistributedDataParallel):
            raise RuntimeError(f"meshddp.DistributedOptimizer: ddp must be a meshddp.DistributedDataParallel, got "
                               f"{type(ddp).__name__}")
        config = _C.DistributedOptimizerConfig() if config is None else config
        if not isinstance(config, _C.DistributedOptimizerConfig):
            raise RuntimeError(f"meshddp.DistributedOptimizer: config must be a meshddp.DistributedOptimizerConfig, got "
                               f"{type(config).__name__}")
        self.ddp = ddp
        self._impl = _C._DistributedOptimizer(ddp._engine, config)
        # Teardown (this object collected, or the interpreter exiting) finishes the param all-gathers
        # still in flight, as finish_param_sync() would: a process must not exit, nor drop the
        # buffers, under a running collective.
        self._teardown = weakref.finalize(self, _finish_pending_gathers, self._impl)
        # One param group per C++ group, holding its trainable params in the GradBuffer's order.
        by_name = dict(ddp.module.named_parameters())
        for module_name, engine_name in ddp._engine_names.items():
            by_name[engine_name] = by_name[module_name]
        names = ddp._engine.param_names()
        groups = [{"params": [], "lr": self._impl.group_lr(g), "weight_decay": self._impl.group_weight_decay(g),
                   "rule": None if g == 0 else config.groups[g - 1][0]} for g in range(self._impl.num_groups())]
        module_path = {engine: module for module, engine in ddp._engine_names.items()}
        for i, name in enumerate(names):
            groups[self._impl.group_of(i)]["params"].append((module_path.get(name, name), by_name[name]))
        super().__init__(groups, {"lr": config.lr, "weight_decay": config.weight_decay})
        # What step() takes from the build, not from param_groups (Note [Param groups are the source of
        # the LR]): each group's params, and the hyperparameters of OptimizerConfig.
        self._built_params = [list(group["params"]) for group in self.param_groups]
        # A group of no params (a frozen stage's chunk) has no "param_names" from torch.
        self._built_names = [list(group.get("param_names", [])) for group in self.param_groups]
        self._config_values = {"betas": (config.beta1, config.beta2), "eps": config.eps, "momentum": config.momentum}
        self._module_path = module_path
        if config.kind == "muon":
            _warn_of_muon_embeddings(ddp.module, by_name, self._impl.muon_params(), config.muon_adamw_params)
            if config.muon_stacked_matrices:
                _warn_of_muon_conv_stacks(ddp.module, by_name, self._impl.muon_params(), config.muon_adamw_params)

    def add_param_group(self, param_group):
        if getattr(self, "_impl", None) is not None and len(self.param_groups) == self._impl.num_groups():
            raise RuntimeError("meshddp.DistributedOptimizer.add_param_group: the param groups are fixed when the "
                               "optimizer is built (one per OptimizerConfig.groups rule, plus the default); give "
                               "the rule in OptimizerConfig(groups=[(pattern, lr, weight_decay)]) instead")
        super().add_param_group(param_group)

    def _check_groups(self):
        """Refuses edits of param_groups that step() would ignore: a group added or removed, a param moved,
        added or dropped, a torch hyperparameter (betas, eps, momentum, ...) set to another value than
        OptimizerConfig's. Only "lr" and "weight_decay" are read from param_groups."""
        built = self._built_params
        if len(self.param_groups) != len(built):
            raise RuntimeError(
                f"meshddp.DistributedOptimizer: param_groups has {len(self.param_groups)} groups, but the optimizer was "
                f"built with {len(built)} (the default, then one per OptimizerConfig.groups rule) and steps by those: "
                f"a group added to or removed from param_groups would be ignored. Give the group as a rule: "
                f"OptimizerConfig(groups=[(pattern, lr, weight_decay)])")
        for g, (group, params, names) in enumerate(zip(self.param_groups, built, self._built_names)):
            now = group["params"]
            if len(now) != len(params) or any(a is not b for a, b in zip(now, params)):
                ids = {id(p) for p in now}
                dropped = [n for n, p in zip(names, params) if id(p) not in ids]
                what = (f"param '{dropped[0]}' was removed from it" if dropped else
                        "a param was added to it" if len(now) > len(params) else "its params were reordered")
                raise RuntimeError(
                    f"meshddp.DistributedOptimizer: param_groups[{g}]['params'] was changed ({what}), but which group a "
                    f"param belongs to is fixed when the optimizer is built (OptimizerConfig.groups rules, first match "
                    f"wins) and step() updates every trainable param by those groups: the change would be ignored. "
                    f"Give a rule for it in OptimizerConfig(groups=[(pattern, lr, weight_decay)]) (lr 0 keeps a param "
                    f"as it is), or set requires_grad=False on it before wrapping")
            for key, value in group.items():
                expected = self._config_values.get(key, False if key in _TORCH_ONLY_OPTIONS else None)
                if expected is None:
                    continue
                same = (tuple(value) == expected) if key == "betas" and isinstance(value, (tuple, list)) else (
                    value == expected)
                if not same:
                    fix = ("OptimizerConfig(beta1=..., beta2=...)" if key == "betas" else
                           f"OptimizerConfig({key}=...)" if key in self._config_values else "nothing: it does not do this")
                    raise RuntimeError(
                        f"meshddp.DistributedOptimizer: param_groups[{g}]['{key}'] is {value!r}, but step() takes "
                        f"'{key}' from its OptimizerConfig ({expected!r}), for every group: only 'lr' and 'weight_decay' "
                        f"are read from param_groups. Set it in {fix} when building the optimizer")

    def _push_groups(self):
        """param_groups' lr and weight_decay into the C++ groups (Note [Param groups are the source of the LR])."""
        self._check_groups()
        for g, group in enumerate(self.param_groups):
            values = {}
            for field in ("lr", "weight_decay"):
                value = group[field]
                value = value.item() if isinstance(value, torch.Tensor) else value
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                    raise ValueError(f"meshddp.DistributedOptimizer: param_groups[{g}]['{field}'] must be a finite "
                                     f"number >= 0, got {value!r}")
                values[field] = float(value)
            self._impl.set_group_lr(g, values["lr"])
            self._impl.set_group_weight_decay(g, values["weight_decay"])

    def _agree_groups(self):
        """One small all-gather over the optimizer's ranks before every step: each param group's "lr" and
        "weight_decay" as param_groups holds them on each rank (a scheduler stepped on a rank-local value, or
        a group edited on one rank, would update each rank's ZeRO-1 shard with its own value). Raises on
        every rank, naming each rank's value, when they differ; compared before they are validated, so
        that a value bad on one rank only fails every rank here alike."""
        import torch.distributed as dist

        mine = [_as_float(group.get(field)) for group in self.param_groups for field in ("lr", "weight_decay")]
        group = self.ddp._world_group
        if dist.get_world_size(group) == 1:
            return
        device = next(self.ddp.module.parameters()).device
        ranks = dist.get_process_group_ranks(group)
        # The group counts first: an all-gather of tensors of different sizes fails inside the backend.
        count = torch.tensor([len(self.param_groups)], dtype=torch.int64, device=device)
        counts = [torch.empty_like(count) for _ in ranks]
        dist.all_gather(counts, count, group=group)
        counts = [int(c.item()) for c in counts]
        if len(set(counts)) > 1:
            each = ", ".join(f"rank {r}: {c}" for r, c in zip(ranks, counts))
            raise RuntimeError(
                f"meshddp.DistributedOptimizer.step: the ranks' optimizers have different numbers of param groups "
                f"({each}). Every rank of a model steps the same param groups; with step_together(), pass each "
                f"rank's chunks' optimizers in the same order (chunk 0 first); nothing was updated")
        local = torch.tensor(mine, dtype=torch.float64, device=device)
        gathered = [torch.empty_like(local) for _ in ranks]
        dist.all_gather(gathered, local, group=group)
        # Bit patterns, so that two NaNs (a value that is no number, validated next) compare equal.
        rows = [t.cpu().view(torch.int64).tolist() for t in gathered]
        if all(row == rows[0] for row in rows):
            return
        values = [t.cpu().tolist() for t in gathered]
        for i in range(len(mine)):
            if len({row[i] for row in rows}) > 1:
                g, field = divmod(i, 2)
                field = ("lr", "weight_decay")[field]
                each = ", ".join(f"rank {r}: {v[i]!r}" for r, v in zip(ranks, values))
                raise RuntimeError(
                    f"meshddp.DistributedOptimizer.step: param_groups[{g}]['{field}'] differs across the ranks "
                    f"({each}): each rank would update its ZeRO-1 shard with its own value. Set it alike on every "
                    f"rank (an LR scheduler stepped on every rank, from values that do not depend on the rank); "
                    f"nothing was updated")

    def _pull_groups(self):
        for g, group in enumerate(self.param_groups):
            group["lr"] = self._impl.group_lr(g)
            group["weight_decay"] = self._impl.group_weight_decay(g)

    def step(self, closure=None, grad_scaler=None):
        """One step (a collective over DP; GIL released): finish_grad_sync() if not done, non-finite
        check, clipping, the sharded update and the param all-gather, with each param group's "lr"
        and "weight_decay" as param_groups holds them now. Returns a StepResult (skipped, grad_norm,
        clipped, report). grad_scaler: passed by torch.amp.GradScaler.step(opt) (fp16 loss scaling):
        the gradients are divided by its scale, and whether they held an inf or NaN is the step's own
        check of the reduced gradients, the same on every rank (StepResult.skipped), which the
        scaler's update() then reads."""
        if grad_scaler is not None:
            return self._step_with_grad_scaler(grad_scaler)
        if closure is not None:
            raise RuntimeError("meshddp.DistributedOptimizer.step: a closure is not supported; run forward and "
                               "backward before step()")
        self._before_step()
        result = self._impl.step()
        self._after_step()
        return result

    @staticmethod
    def step_together(optimizers):
        """One step of every model chunk's optimizer this rank holds (a pipeline with several stages per
        rank, e.g. interleaved or V-shaped schedules: one DistributedOptimizer per chunk), as one
        optimizer: one gradient norm over every chunk of every stage, one clipping coefficient, one skip
        decision (Megatron's chained optimizer). Every rank passes all of its chunks' optimizers; step()
        on one of several refuses, naming this. Returns the one StepResult."""
        optimizers = list(optimizers)
        for opt in optimizers:
            if not isinstance(opt, DistributedOptimizer):
                raise TypeError(f"meshddp.DistributedOptimizer.step_together: expected meshddp.DistributedOptimizer "
                                f"objects, got {type(opt).__name__}")
        for opt in optimizers:
            opt._before_step()
        result = _C._DistributedOptimizer.step_together([opt._impl for opt in optimizers])
        for opt in optimizers:
            opt._after_step()
            opt._opt_called = True  # what torch's LR schedulers' wrapper of step() records
        return result

    def _before_step(self):
        """step()'s checks and the param groups pushed into the C++ groups."""
        if self.ddp._grads_written_since_sync():
            raise RuntimeError(
                "meshddp.DistributedOptimizer.step: the gradients were changed in place after finish_grad_sync() "
                "(e.g. by torch.nn.utils.clip_grad_norm_). The buffer is sharded for the ZeRO-1 distributed "
                "optimizer (use_distributed_optimizer), so each DP rank holds the reduced gradient of its shard "
                "only: torch's clip_grad_norm_ takes the norm of unreduced gradients, and would clip a second time "
                "after the optimizer's own clipping. Set meshddp.DistributedOptimizerConfig(clip_grad_norm=max_norm) instead "
                "(step() clips and reports StepResult.grad_norm); nothing was updated")
        self.ddp.finish_grad_sync()  # through the DDP: its checks (a DTensor param frozen after wrapping)
        self._agree_groups()
        self._push_groups()

    def _after_step(self):
        self.ddp._synced_grad_version = None  # the step itself scales and reads the gradients
        self.ddp._grads_state = "stepped"

    def _step_with_grad_scaler(self, grad_scaler):
        from torch.amp.grad_scaler import OptState

        state = grad_scaler._per_optimizer_states[id(self)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "meshddp.DistributedOptimizer.step: GradScaler.unscale_(optimizer) was called before "
                "GradScaler.step(optimizer); it unscales .grad only on this rank's view (fp32 main grads of bf16/fp16 "
                "params are not .grad) and checks for infs on it. Leave unscaling to step() (call scaler.step(opt) "
                "directly); to clip, set OptimizerConfig(clip_grad_norm=max_norm), which clips the unscaled gradient")
        chunks = _C._pipeline_chunks_of(self.ddp._engine)
        if chunks > 1:  # refused before the gradients are unscaled, not after
            raise RuntimeError(
                f"meshddp.DistributedOptimizer.step: GradScaler.step(optimizer) on one of the {chunks} model chunks "
                f"this rank holds of the pipeline: the gradient norm, clipping and the skip cover every chunk, and "
                f"step_together() takes no GradScaler yet; use bf16 (no loss scaling), or one chunk per rank; "
                f"nothing was changed")
        self.ddp.finish_grad_sync()
        self.ddp.scale_gradients(1.0 / grad_scaler.get_scale())  # the synced shards too: elementwise
        result = self.step()
        found_inf = torch.full((), 1.0 if result.skipped else 0.0, dtype=torch.float32, device=grad_scaler._scale.device)
        state["found_inf_per_device"] = {found_inf.device: found_inf}
        return result

    def zero_grad(self, set_to_none=True):
        """Same as ddp.zero_grad_buffer() (the gradients stay views of the buffer, whatever set_to_none)."""
        self.ddp.zero_grad_buffer()

    def finish_param_sync(self):
        """Waits for the params' all-gathers (before reading params outside ddp's forward). On Gloo the
        host blocks until they are done. On NCCL it is a stream wait: it returns at once, and the current
        CUDA stream is ordered after the all-gathers, so work queued on that stream afterwards sees the
        new params; another stream, another thread's stream, or a non_blocking copy to the host is not
        ordered by it (make that stream wait on torch.cuda.current_stream(), or synchronize it first).
        .item() and .cpu() synchronize the current stream themselves."""
        self._impl.finish_param_sync()

    def reload_masters_from_params(self):
        """Refreshes this rank's fp32 master weights from the params, after writing new values into the
        params other than by ddp.load_state_dict() (which makes the next step() do this by itself).
        A no-op for fp32 params, whose masters are the param buffer itself."""
        self._impl.reload_masters_from_params()

    def set_lr(self, lr):
        """Sets every param group's learning rate to lr x its ratio to the base lr, from the next step()."""
        self._push_groups()
        self._impl.set_lr(lr)
        self._pull_groups()

    def set_weight_decay(self, weight_decay):
        """Sets every param group's weight decay to weight_decay x its ratio to the base weight decay (a group
        whose own weight decay was set while the base is 0 keeps it), from the next step()."""
        self._push_groups()
        self._impl.set_weight_decay(weight_decay)
        self._pull_groups()

    def set_group_lr(self, group, lr):
        """Sets param group `group`'s learning rate (0: the default group, then one per rule)."""
        self._push_groups()
        self._impl.set_group_lr(group, lr)
        self._pull_groups()

    def save_checkpoint(self, directory, keep_last=0, async_save=False, if_busy="wait"):
        """Sharded checkpoint: every DP rank writes its shard, DP rank 0 the manifest (docs/reference/optimizer.md).

        keep_last=K (> 0) then keeps the K newest checkpoints of this run (the one it loaded and those
        it saved since; docs/reference/checkpoints.md, "The live run") and deletes the other step directories.

        async_save=True returns after a copy of this rank's shards to host memory: a background thread
        writes them, and the checkpoint is committed (`latest` moved) at a later checkpoint_step_boundary()
        or wait_checkpoint(), which every rank calls at every step boundary / at the end of training
        (docs/reference/checkpoints.md, "Asynchronous saves"). Returns {"path", "stall_ms", "waited_ms",
        "snapshot_ms"}. A save while the previous async one is still being written waits for it
        (if_busy="wait") or raises (if_busy="refuse"), on every rank."""
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 0:
            raise ValueError(f"meshddp.DistributedOptimizer.save_checkpoint: keep_last must be an int >= 0, got {keep_last!r}")
        if if_busy not in ("wait", "refuse"):
            raise ValueError(f"meshddp.DistributedOptimizer.save_checkpoint: if_busy must be 'wait' or 'refuse', got {if_busy!r}")
        if not async_save:
            if getattr(self, "_async", None) is not None and self._async.pending:
                self._report(self._async.wait())  # one save at a time
            self._impl.save_checkpoint(os.fspath(directory), keep_last)
            return None
        if getattr(self, "_async", None) is None:
            self._async = _C._AsyncCheckpointSave(self._impl)
        path, stall, waited, snapshot, previous = self._async.start(self._impl, os.fspath(directory), keep_last,
                                                                    if_busy == "refuse")
        self._report(previous)
        return {"path": path, "stall_ms": stall, "waited_ms": waited, "snapshot_ms": snapshot}

    def checkpoint_step_boundary(self):
        """Call at every step boundary on every rank (a collective while an async save is pending; nothing
        otherwise): commits the pending async save once every rank's file is written. Returns
        ("committed", path) once, ("pending", path) before, None without a pending save; raises
        RuntimeError on every rank, naming each failing rank and its file, when a write failed (the
        previous checkpoint stays `latest`)."""
        if getattr(self, "_async", None) is None:
            return None
        return self._report(self._async.poll())

    def wait_checkpoint(self):
        """A collective: waits for the pending async save and commits it (the end of training, or before a
        load). Returns ("committed", path), or None without one; raises as checkpoint_step_boundary()."""
        if getattr(self, "_async", None) is None:
            return None
        return self._report(self._async.wait())

    @staticmethod
    def _report(report):
        kind, _step, path, message, _write_ms = report
        if kind == "failed":
            raise RuntimeError(message)
        return None if kind == "none" else (kind, path)

    def load_checkpoint(self, directory):
        """Loads a checkpoint saved at this or another DP size, then all-gathers params (after waiting for
        a pending async save: wait_checkpoint())."""
        self.wait_checkpoint()
        self._impl.load_checkpoint(os.fspath(directory))
        self._pull_groups()

    def state_dict(self):
        """This rank's optimizer state in the form torch.distributed.checkpoint saves and reshards across DP
        sizes: {"state": {param: {"exp_avg", "exp_avg_sq" | "momentum_buffer", "master" (bf16/fp16 params)}},
        "step", "lr", "param_groups"}, each state a ShardedTensor over the flattened param whose local shard is
        a view (no copy) of this rank's ZeRO-1 range of it. A freshly built optimizer's dict already holds
        every tensor, so dcp.load(sd) fills the optimizer in place; then call load_state_dict(sd). Save and
        load it with the model's: {"model": ddp.state_dict(), "optim": opt.state_dict()} (an fp32 param is its
        own master). With TP > 1 the keys name the TP rank: reshards over DP, at the same TP size.
        Note [The optimizer state for DCP] in meshddp/_state_dict.py; docs/reference/checkpoints.md."""
        if self.ddp.config.expert_parallel_size > 1 and any(
                _C._is_expert_param(getattr(p, "_local_tensor", p)) for p in self.ddp.parameters()):
            raise RuntimeError(
                "meshddp.DistributedOptimizer.state_dict: the model has expert params over expert_parallel_size "
                f"{self.ddp.config.expert_parallel_size}, whose ZeRO-1 shards are laid out over the expert-data-"
                "parallel group, which this DCP layout (shards over DP) does not describe yet; use "
                "save_checkpoint() / load_checkpoint() (meshddp's format) for this model")
        self._push_groups()
        return _state_dict.build(self)

    def load_state_dict(self, state_dict):
        """Applies a state_dict() filled by torch.distributed.checkpoint.load (at any DP size): checks it all
        (names the parameter and state that is missing or shaped otherwise) before changing anything, then
        the state, the step count, the learning rates; writes the masters into the params and all-gathers
        them (a collective over the mesh). Training then continues as if never stopped."""
        _state_dict.load(self, state_dict)
        self._pull_groups()

    @property
    def steps_taken(self):
        return self._impl.steps_taken()

    @property
    def config(self):
        return self._impl.config

    def memory(self):
        """Bytes held by this rank, by component (param/grad buffers, masters, optimizer state)."""
        return self._impl.memory()

    @property
    def muon_params(self):
        """kind="muon": the names of the params Muon updates (2-D, or 3-D stacks of matrices with
        muon_stacked_matrices, matching none of muon_adamw_params), in registration order; the others
        take AdamW. Empty for other kinds."""
        return [self._module_path.get(name, name) for name in self._impl.muon_params()]
