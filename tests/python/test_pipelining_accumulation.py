"""Gradient accumulation across torch.distributed.pipelining schedule.step() calls with
meshddp.pipelining.PipelineStage (pipelining_accumulation_workers.py): dp 2 x pp 2 on 4 Gloo
processes, the MLP of pipelining_workers.py, 2 schedule.step() calls of 4 micro-batches per optimizer
step, 2 SGD steps. Golden: one process on the same global batches, the two steps' mean losses
backpropagated one after the other (their gradients summed). Tolerance 3e-7 (fp32; measured 7e-9 to
3e-8). torch's own DDP in torch's stage accumulates too (each step syncs and adds onto .grad), but its
scale_grads divides the earlier steps' gradients again; meshddp's stage scales each step's own.

What the cases check:
- 2 schedule.step() calls per optimizer step (1F1B, Interleaved1F1B, ZBVZeroBubble, ZeRO-1; finish_grad_sync
  between or not; scale_grads on and off) vs one process on the same batches: within 3e-7 (measured 3e-8); a
  step after an optimizer step (torch's SGD, or meshddp's ZeRO-1 DistributedOptimizer) without
  zero_grad_buffer() refused on every rank; under data_parallel_sharding_strategy='optim_grads' and
  'optim_grads_params' (no whole gradient to set aside) the second schedule.step() refused on every rank,
  naming the strategy and the way out
"""

import pytest

import multiprocess

TOL = 3e-7


@pytest.mark.parametrize("schedule,finish_between,scale_grads,zero1,eval_between", [
    ("1F1B", False, True, False, False),
    ("1F1B", True, False, False, False),
    ("Interleaved1F1B", False, True, False, True),
    ("ZBVZeroBubble", True, True, False, False),
    ("1F1B", False, True, True, False),
])
def test_two_schedule_steps_per_optimizer_step_match_one_process(schedule, finish_between, scale_grads, zero1,
                                                                 eval_between):
    """eval_between: a schedule.eval() (forward only) between the two schedule.step() calls; torch's schedules
    call the stage's scale_grads even then, which divided the first step's synced gradients (0.087 off)."""
    diffs = multiprocess.run(4, "pipelining_accumulation_workers.accumulated", schedule=schedule,
                             finish_between=finish_between, scale_grads=scale_grads, zero1=zero1,
                             eval_between=eval_between)
    assert all(isinstance(d, tuple) for d in diffs), diffs
    assert max(max(d) for d in diffs) < TOL, diffs


@pytest.mark.parametrize("schedule,ending,zero1,grad_reduction", [
    ("1F1B", "stage_twice", False, "sum"),
    ("1F1B", "ddp", False, "mean"),
    ("1F1B", "optimizer", True, "mean"),
    ("Interleaved1F1B", "ddp_twice", True, "sum"),
])
def test_every_way_to_end_an_accumulation_gives_one_process_gradients(schedule, ending, zero1, grad_reduction):
    """The last schedule.step() of each optimizer step finished by meshddp.pipelining.finalize_model_grads(stages),
    each chunk's ddp.finish_grad_sync(), either twice (a second call is a no-op), or nothing before
    DistributedOptimizer.step() (which finishes it): the same gradients. Broken on purpose, each fails: a
    second stage call scaled the buffers again (grad_reduction="sum": times the DP size each call); the DDP's
    method and the optimizer's step did not add back the earlier schedule.step()'s set-aside gradients."""
    diffs = multiprocess.run(4, "pipelining_accumulation_workers.accumulated", schedule=schedule, ending=ending,
                             zero1=zero1, grad_reduction=grad_reduction)
    assert all(isinstance(d, tuple) for d in diffs), diffs
    assert max(max(d) for d in diffs) < TOL, diffs


def test_an_accumulation_discarded_by_zero_grad_buffer_leaves_nothing_for_the_next_step():
    """Two schedule.step() calls, each DDP's finish_grad_sync(), then zero_grad_buffer() (an accumulation
    thrown away, e.g. after a NaN loss): the next optimizer steps match one process that never saw those
    batches. Broken on purpose (the set-aside gradients not cleared by zero_grad_buffer()): they leaked in."""
    diffs = multiprocess.run(4, "pipelining_accumulation_workers.accumulated", discard_first=True)
    assert all(isinstance(d, tuple) for d in diffs), diffs
    assert max(max(d) for d in diffs) < TOL, diffs


@pytest.mark.parametrize("zero1", [False, True])
def test_a_step_after_an_optimizer_step_without_zeroing_is_refused_on_every_rank(zero1):
    messages = multiprocess.run(4, "pipelining_accumulation_workers.step_without_zeroing", zero1=zero1)
    for m in messages:
        assert m is not None and "schedule.step() after an optimizer step without zero_grad_buffer()" in m, m
        assert "still hold the gradients the optimizer stepped on" in m and "zero_grad_buffer() on every chunk" in m, m


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_accumulating_across_schedule_steps_with_sharded_gradients_is_refused_on_every_rank(strategy):
    messages = multiprocess.run(4, "pipelining_accumulation_workers.accumulated", zero1=True, strategy=strategy)
    for rank, message in enumerate(messages):
        assert isinstance(message, str), f"rank {rank} accumulated under {strategy}: {message}"
        for text in ("schedule.step() again before the optimizer step", f"strategy='{strategy}'", "n_microbatches",
                     "data_parallel_sharding_strategy='optim'"):
            assert text in message, (rank, text, message)
