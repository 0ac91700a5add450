"""meshddp.DistributedOptimizer: the ZeRO-1 optimizer (C++) over a meshddp.DistributedDataParallel
built with DdpConfig(use_distributed_optimizer=True): each DP rank keeps fp32 master weights and
AdamW/SGD state for its 1/DP shard of every bucket; step() updates them and all-gathers params."""

import os
import warnings
import weakref

from meshddp import _C, _state_dict
from meshddp.ddp import DistributedDataParallel


def _finish_pending_gathers(impl):
    try:
        impl.finish_param_sync()
    except Exception as e:  # noqa: BLE001 (at teardown: say it, do not raise into the interpreter's exit)
        warnings.warn(f"meshddp.DistributedOptimizer: the param all-gathers pending at teardown failed: {e}")


class DistributedOptimizer:
    def __init__(self, ddp, config=None):
        if not isinstance(ddp, DistributedDataParallel):
            raise RuntimeError(f"meshddp.DistributedOptimizer: ddp must be a meshddp.DistributedDataParallel, got "
                               f"{type(ddp).__name__}")
        config = _C.OptimizerConfig() if config is None else config
        if not isinstance(config, _C.OptimizerConfig):
            raise RuntimeError(f"meshddp.DistributedOptimizer: config must be a meshddp.OptimizerConfig, got "
                               f"{type(config).__name__}")
        self.ddp = ddp
        self._impl = _C._DistributedOptimizer(ddp._engine, config)
        # Teardown (this object collected, or the interpreter exiting) finishes the param all-gathers
        # still in flight, as finish_param_sync() would: a process must not exit, nor drop the
        # buffers, under a running collective.
        self._teardown = weakref.finalize(self, _finish_pending_gathers, self._impl)

    def step(self):
        """One step (a collective over DP; GIL released): finish_grad_sync() if not done, non-finite
        check, clipping, the sharded update and the param all-gather. Returns a StepResult
        (skipped, grad_norm, clipped, report)."""
        self.ddp.finish_grad_sync()  # through the DDP: its checks (a DTensor param frozen after wrapping)
        return self._impl.step()

    def zero_grad(self):
        """Same as ddp.zero_grad_buffer()."""
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
        self._impl.set_lr(lr)

    def set_group_lr(self, group, lr):
        """Sets param group `group`'s learning rate (0: the default group, then one per rule)."""
        self._impl.set_group_lr(group, lr)

    def save_checkpoint(self, directory, keep_last=0, async_save=False, if_busy="wait"):
        """Sharded checkpoint: every DP rank writes its shard, DP rank 0 the manifest (docs/optimizer.md).

        keep_last=K (> 0) then keeps the K newest checkpoints of this run (the one it loaded and those
        it saved since; docs/checkpoints.md, "The live run") and deletes the other step directories.

        async_save=True returns after a copy of this rank's shards to host memory: a background thread
        writes them, and the checkpoint is committed (`latest` moved) at a later checkpoint_step_boundary()
        or wait_checkpoint(), which every rank calls at every step boundary / at the end of training
        (docs/checkpoints.md, "Asynchronous saves"). Returns {"path", "stall_ms", "waited_ms",
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

    def state_dict(self):
        """This rank's optimizer state in the form torch.distributed.checkpoint saves and reshards across DP
        sizes: {"state": {param: {"exp_avg", "exp_avg_sq" | "momentum_buffer", "master" (bf16/fp16 params)}},
        "step", "lr", "param_groups"}, each state a ShardedTensor over the flattened param whose local shard is
        a view (no copy) of this rank's ZeRO-1 range of it. A freshly built optimizer's dict already holds
        every tensor, so dcp.load(sd) fills the optimizer in place; then call load_state_dict(sd). Save and
        load it with the model's: {"model": ddp.state_dict(), "optim": opt.state_dict()} (an fp32 param is its
        own master). With TP > 1 the keys name the TP rank: reshards over DP, at the same TP size.
        Note [The optimizer state for DCP] in meshddp/_state_dict.py; docs/checkpoints.md."""
        return _state_dict.build(self)

    def load_state_dict(self, state_dict):
        """Applies a state_dict() filled by torch.distributed.checkpoint.load (at any DP size): checks it all
        (names the parameter and state that is missing or shaped otherwise) before changing anything, then
        the state, the step count, the learning rates; writes the masters into the params and all-gathers
        them (a collective over the mesh). Training then continues as if never stopped."""
        _state_dict.load(self, state_dict)

    @property
    def steps_taken(self):
        return self._impl.steps_taken()

    @property
    def config(self):
        return self._impl.config

    def memory(self):
        """Bytes held by this rank, by component (param/grad buffers, masters, optimizer state)."""
        return self._impl.memory()
