"""meshddp.DcpStager: the staging step of torch.distributed.checkpoint.async_save for state dicts that
hold ShardedTensors, such as DistributedOptimizer.state_dict().

torch's default stager (DefaultStager, torch 2.11) deep-copies a state dict tensor by tensor and
fails on a ShardedTensor (`torch function 'data_ptr' ... not supported for ShardedTensor!`). This one
copies every tensor to host memory, and each ShardedTensor's local shards into a new ShardedTensor
with the same global metadata, so that training may change the live state while DCP's writer thread
saves the copy:

    side = dist.new_group(backend="gloo")      # once: DCP's collectives run on its writer thread
    stager = meshddp.DcpStager()               # once: its host buffers are reused by every save
    future = dcp.async_save({"model": ddp.state_dict(), "optim": opt.state_dict()},
                            checkpoint_id=f"ckpt/step-{step}", process_group=side, async_stager=stager)
    ...                                        # training goes on
    future.result()                            # before the next save (it reuses the buffers) and at exit

The copies are reused from one save to the next while the tensors keep their shapes and dtypes (one
host copy of this rank's state: its model params and buffers plus its shards of the optimizer
state); so a save must have finished (future.result()) before the next one is staged."""

import torch
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor


class DcpStager:
    """An AsyncStager (torch.distributed.checkpoint.staging) that copies synchronously, in stage()."""

    _synchronize_after_execute = False

    def __init__(self):
        self._buffers = {}  # key path -> host tensor, reused while shape and dtype stay

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
        return buf

    def _stage(self, path, value):
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

    def stage(self, state_dict):
        """A copy of `state_dict` in host memory (ShardedTensors as ShardedTensors of copied shards)."""
        return self._stage("", state_dict)

    def synchronize_staging(self):
        """Nothing to wait for: stage() copies before it returns."""

    def close(self):
        self._buffers.clear()
