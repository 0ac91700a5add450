"""meshddp.DistributedOptimizer: the ZeRO-1 optimizer (C++) over a meshddp.DistributedDataParallel
built with DdpConfig(use_distributed_optimizer=True): each DP rank keeps fp32 master weights and
AdamW/SGD state for its 1/DP shard of every bucket; step() updates them and all-gathers params."""

import os
import warnings
import weakref

from meshddp import _C
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
        return self._impl.step()

    def zero_grad(self):
        """Same as ddp.zero_grad_buffer()."""
        self.ddp.zero_grad_buffer()

    def finish_param_sync(self):
        """Blocks until params are all-gathered (before reading params outside ddp's forward)."""
        self._impl.finish_param_sync()

    def set_lr(self, lr):
        """Sets every param group's learning rate to lr x its ratio to the base lr, from the next step()."""
        self._impl.set_lr(lr)

    def set_group_lr(self, group, lr):
        """Sets param group `group`'s learning rate (0: the default group, then one per rule)."""
        self._impl.set_group_lr(group, lr)

    def save_checkpoint(self, directory):
        """Sharded checkpoint: every DP rank writes its shard, DP rank 0 the manifest (docs/optimizer.md)."""
        self._impl.save_checkpoint(os.fspath(directory))

    def load_checkpoint(self, directory):
        """Loads a checkpoint saved at this or another DP size, then all-gathers params."""
        self._impl.load_checkpoint(os.fspath(directory))

    @property
    def steps_taken(self):
        return self._impl.steps_taken()

    @property
    def config(self):
        return self._impl.config

    def memory(self):
        """Bytes held by this rank, by component (param/grad buffers, masters, optimizer state)."""
        return self._impl.memory()
