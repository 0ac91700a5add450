"""Module buffers under meshddp.pipelining.PipelineStage (pipelining_buffers_workers.py): a model whose
forward saves a buffer for backward (a rotary table), Schedule1F1B over dp 2 x pp 2 (4 Gloo processes),
DP rank 1's tables drifted between optimizer steps; 2 SGD steps against one process on the global batch.
Tolerance 3e-7 (fp32). The buffers are broadcast once per optimizer step, before its first forward, and
only where they differ from DP rank 0's (Note [Module buffers once per step], plugin/distributed_data_parallel.cpp).
Broken on purpose (DdpEngine::before_forward as it was: a broadcast written over every buffer before
every forward outside no_sync(), PyTorch DDP's rule): DP rank 1 fails in micro-batch 0's backward,
"modified by an inplace operation"."""

import pytest

import multiprocess

TOL = 3e-7


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_buffer_saved_for_backward_trains_under_1f1b_on_every_dp_rank(accumulate):
    """accumulate=2: two schedule.step() calls per optimizer step; the second broadcasts nothing."""
    results = multiprocess.run(4, "pipelining_buffers_workers.rotated_pipeline", accumulate=accumulate)
    assert max(d for d, _ in results) < TOL and all(once for _, once in results), results
