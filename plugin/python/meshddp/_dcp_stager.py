"""meshddp.DcpStager: the staging step of torch.distributed.checkpoint.async_save for state dicts that
hold ShardedTensors, such as DistributedOptimizer.state_dict(), and DTensors (a torch-TP model's
ddp.state_dict()).

torch's default stager (DefaultStager, torch 2.11) deep-copies a state dict tensor by tensor and
fails on a ShardedTensor (`torch function 'data_ptr' ... not supported for ShardedTensor!`). This one
copies every tensor to host memory, each ShardedTensor's local shards into a new ShardedTensor with
the same global metadata, and each DTensor's local shard into a new DTensor with the same mesh and
placements, so that training may change the live state while DCP's writer thread saves the copy:

    side = dist.new_group(backend="gloo")      # once: DCP's collectives run on its writer thread
    stager = meshddp.DcpStager()               # once: its host buffers are reused by every save
    future = dcp.async_save({"model": ddp.state_dict(), "optim": opt.state_dict()},
                            checkpoint_id=f"ckpt/step-{step}", process_group=side, async_stager=stager)
    ...                                        # training goes on
    future.result()                            # before the next save (it reuses the buffers) and at exit

The copies are reused from one save to the next while the tensors keep their shapes and dtypes (one
host copy of this rank's state: its model params and buffers plus its shards of the optimizer
state). A save staged while the previous one is still being written (future.result() not called:
DCP's writer still holds the previous copy) gets new host buffers, with a warning, so that the
previous save is never overwritten under its writer (a second copy's memory until it finishes).
future.result() returns when DCP's writer thread sets it, a moment before that thread lets go of the
copy; stage() gives a held copy up to a second to be let go before it counts it as still held."""

import gc
import time
import warnings
import weakref

import torch
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed.tensor import DTensor


class DcpStager:
    """An AsyncStager (torch.distributed.checkpoint.staging) that copies synchronously, in stage()."""

    _synchronize_after_execute = False
    _release_grace_s = 1.0  # how long stage() waits for a finished writer's thread to let go of its copy

    def __init__(self):
        self._buffers = {}  # key path -> host tensor, reused while shape and dtype stay
        self._handed_out = []  # weak refs to the views of the buffers the last stage() returned

    @property
    def should_synchronize_after_execute(self):
        return self._synchronize_after_execute

    def _copy(self, path, t):
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
            self._buffers[path] = buf
        with torch.no_grad():
            buf.copy_(t.detach())
        view = buf.view(buf.shape)  # a new object per save: alive while that save's writer holds it
        self._handed_out.append(weakref.ref(view))
        return view

    def _stage(self, path, value):
        if isinstance(value, DTensor):
            # A torch-TP param (or its state): its local shard copied, under the same mesh and placements.
            # Built from the spec, not DTensor.from_local, which would move the copy back to the mesh's device.
            return DTensor(self._copy(f"{path}#local", value._local_tensor), value._spec, requires_grad=False)
        if isinstance(value, ShardedTensor):
            shards = [Shard(self._copy(f"{path}#{i}", s.tensor), s.metadata) for i, s in enumerate(value.local_shards())]
            return ShardedTensor._init_from_local_shards_and_global_metadata(shards, value.metadata())
        if isinstance(value, torch.Tensor):
            return self._copy(path, value)
        if isinstance(value, dict):
            return {k: self._stage(f"{path}/{k}", v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._stage(f"{path}/{i}", v) for i, v in enumerate(value))
        return value

    def _previous_copy_still_held(self):
        """Whether a view stage() handed out last time is still alive after the grace period: its writer
        thread may have set the future's result but not yet dropped the arguments it was called with."""
        deadline = time.monotonic() + self._release_grace_s
        collected = False
        while any(ref() is not None for ref in self._handed_out):
            if not collected:
                gc.collect()  # a copy kept alive only by a reference cycle is not held by a writer
                collected = True
            elif time.monotonic() >= deadline:
                return True
            else:
                time.sleep(0.002)
        return False

    def stage(self, state_dict):
        """A copy of `state_dict` in host memory (ShardedTensors as ShardedTensors of copied shards)."""
        if self._previous_copy_still_held():
            warnings.warn("meshddp.DcpStager: a checkpoint was staged while the previous one is still held by its "
                          "writer (dcp.async_save's future.result() not called yet); it is copied into new host "
                          "buffers (a second copy of this rank's state) so that the previous save is not overwritten "
                          "while it is written. Call future.result() before the next save to keep one copy")
            self._buffers = {}
        self._handed_out = []
        return self._stage("", state_dict)

    def synchronize_staging(self):
        """Nothing to wait for: stage() copies before it returns."""

    def close(self):
        self._buffers.clear()
