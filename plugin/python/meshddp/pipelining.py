"""torch.distributed.pipelining with meshddp as the data-parallel wrapper (docs/pipeline.md, "From
Python: torch.distributed.pipelining"): PipelineStage, a drop-in for torch's, whose submodule is a
meshddp.DistributedDataParallel. torch's stage drives only torch's DDP (through its Reducer) and FSDP2;
any other wrapper gets a plain backward with no sync control, and its scale_grads divides p.grad, which
a flat-buffer DDP's optimizer does not read. This stage overrides those hooks:

- backward_maybe_with_nosync: every backward (full, the input pass and the weight pass of a split
  backward) runs with the chunk's sync held, so gradients only accumulate into the flat buffers and a
  weight's gradient arriving in a later weight pass is counted once.
- perform_reduce_grad (the schedule's REDUCE_GRAD action, after the chunk's last backward) and
  scale_grads (called by the schedules without that action right after the last backward): the flat
  buffers are scaled (scale_gradients) and the chunk's sync is started (start_grad_sync), overlapping
  the other chunks' backward; both at most once per step.
- finish_grad_sync(stages) waits for every chunk's sync: call it after schedule.step() and before the
  optimizer step."""

from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

from meshddp.ddp import DistributedDataParallel


def _error(what):
    return RuntimeError(f"meshddp.pipelining.{what}")


class PipelineStage(_TorchPipelineStage):
    """torch.distributed.pipelining.PipelineStage (same arguments) whose `submodule` is a
    meshddp.DistributedDataParallel. Per step: zero each chunk's buffer (submod.zero_grad_buffer()),
    schedule.step(...), meshddp.pipelining.finish_grad_sync(stages), optimizer.step()."""

    def __init__(self, submodule, *args, **kwargs):
        if not isinstance(submodule, DistributedDataParallel):
            raise _error(f"PipelineStage: submodule must be a meshddp.DistributedDataParallel "
                         f"(wrap the stage's module first), got {type(submodule).__name__}; for a module without "
                         f"meshddp use torch.distributed.pipelining.PipelineStage")
        super().__init__(submodule, *args, **kwargs)
        self._sync_started = False

    def clear_runtime_states(self):
        """torch's per-step reset (schedule.step() calls it first): this step's sync not started yet. A
        sync of the previous step still in flight is caught by the DDP's forward check."""
        super().clear_runtime_states()
        self._sync_started = False

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        ddp = self.submod
        if self._sync_started:
            raise _error(f"PipelineStage {self.stage_index}: a backward after its chunk's gradient sync was started "
                         f"(REDUCE_GRAD ran before this step's last backward); call "
                         f"meshddp.pipelining.finish_grad_sync(stages) and zero_grad_buffer() between steps")
        ddp.set_requires_gradient_sync(False)
        try:
            # torch's base with a non-torch-DDP submod: a plain backward (stage_backward, or the split
            # stage_backward_input / stage_backward_weight); the held sync makes it accumulate only.
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=False)
        finally:
            ddp.set_requires_gradient_sync(True)

    def scale_grads(self, grad_scale_factor):
        """Divides the chunk's flat gradient buffers by `grad_scale_factor` (the micro-batch count with
        the schedule's scale_grads=True, else 1), then starts the chunk's sync (once per step)."""
        if self._sync_started:
            return  # the schedule's REDUCE_GRAD already scaled and started this chunk
        if grad_scale_factor != 1:
            self.submod.scale_gradients(1.0 / grad_scale_factor)
        self.submod.start_grad_sync()
        self._sync_started = True

    def perform_reduce_grad(self, grad_scale_factor):
        self.scale_grads(grad_scale_factor)

    def finish_grad_sync(self):
        """Waits for this chunk's sync (starting it first if the schedule never did); idempotent."""
        if not self._sync_started:
            self.scale_grads(1)
        self.submod.finish_grad_sync()
        self._sync_started = False


def finish_grad_sync(stages):
    """Finishes every stage's gradient sync on this rank (the .grad of each param then holds the DP
    mean): after schedule.step(), before the optimizer step. `stages`: a PipelineStage or a list."""
    for stage in stages if isinstance(stages, (list, tuple)) else [stages]:
        if not isinstance(stage, PipelineStage):
            raise _error(f"finish_grad_sync: expected meshddp.pipelining.PipelineStage, got {type(stage).__name__}")
        stage.finish_grad_sync()
