"""The data-parallel side of a pipeline schedule from Python (docs/guide/pipelines.md): the per-chunk
controls on one rank, and a 2-stage toy pipeline with an embedding tied to the LM head, per-token loss
(pipeline_workers.py), against one process. Tolerance 2e-6 (fp32 SGD, 3 steps; ~1e-7 measured)."""

import pytest
import torch

import meshddp
import multiprocess


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.fc1, self.fc2 = torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def test_controls_hold_start_finish_and_scale(mesh):
    model, ref = Mlp(), Mlp()
    config = meshddp.DdpConfig(bucket_bytes=64)
    ddp = meshddp.DistributedDataParallel(model, mesh, config=config)
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(5))
    ddp.zero_grad_buffer()
    ddp.set_requires_gradient_sync(False)
    for m in range(3):
        (ddp(x.chunk(3)[m]).pow(2).mean() / 3).backward()
    assert ddp._engine.buckets_launched_by_hooks() == 0
    ddp.start_grad_sync()
    with pytest.raises(RuntimeError, match="in flight"):
        ddp.scale_gradients(2.0)
    ddp.finish_grad_sync()
    ddp.finish_grad_sync()  # idempotent
    ddp.scale_gradients(0.5)
    ddp.set_requires_gradient_sync(True)
    sum(ref(x.chunk(3)[m]).pow(2).mean() / 3 for m in range(3)).mul(0.5).backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="2 chunk\\(s\\) were given"):
        meshddp.finalize_model_grads([ddp, ddp])  # a chunk of V = 1 given as two
    with pytest.raises(ValueError, match="2.7 is not a whole number of tokens"):
        meshddp.finalize_model_grads([ddp], num_tokens=2.7)  # never truncated to 2
    assert meshddp.finalize_model_grads([ddp], num_tokens=torch.tensor(6)) == 6  # torchtitan's tensor count


def test_embedding_groups_pair_first_and_last_stage():
    assert meshddp.groups.embedding_groups([2, 3], ["dp", "pp"]) == [[0, 2], [1], [3, 5], [4]]


def test_tied_pipeline_matches_one_process():
    diffs = multiprocess.run(2, "pipeline_workers.tied_pipeline")
    assert max(diffs) < 2e-6, diffs
