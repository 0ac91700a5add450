"""A pipeline is one training run (pipelining_norm_workers.py): torch's schedules over dp 2 x pp 2 (4 ranks,
Gloo, CPU), the MLP of test_pipelining.py, 3 SGD steps clipped to a norm below every step's.

- the gradient norm is the whole model's (every chunk of every stage), equal to torch's clip_grad_norm_ in
  one process on the global batch within 1e-6 relative (fp32 sums split differently; measured ~1e-7), and
  the clipped params equal one process's within 3e-7 (as test_pipelining.py): plain DDP through
  meshddp.clip_grad_norm_(list of the rank's chunks), ZeRO-1 through DistributedOptimizer.step_together, and so
  under data_parallel_sharding_strategy='optim_grads_params' (interleaved, 2 chunks a rank; measured as ZeRO-1);
- a NaN in one stage's gradient makes every stage skip the step (ZeRO-1), nothing updated anywhere;
- a norm or a step over part of a rank's chunks is refused, naming the call to make; stages that clip to
  other bounds are refused on every rank; a second model pipelined over the same mesh is no extra chunk."""

import math

import pytest

import multiprocess

TOL = 3e-7


@pytest.mark.parametrize("zero1", [False, True])
@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_clipping_by_the_pipelines_norm_matches_one_process(schedule, zero1):
    results = multiprocess.run(4, "pipelining_norm_workers.clipped", schedule=schedule, zero1=zero1)
    for norms, ref_norms, worst in results:
        assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(norms, ref_norms)), (norms, ref_norms)
        assert worst < TOL, worst


def test_clipping_under_optim_grads_params_matches_one_process():
    """Every chunk's params sharded (ZeRO-3): the norm over the gradient shards of every chunk of every stage."""
    results = multiprocess.run(4, "pipelining_norm_workers.clipped", schedule="Interleaved1F1B", zero1=True,
                               strategy="optim_grads_params")
    for norms, ref_norms, worst in results:
        print(f"[optim_grads_params: norms {norms}, one process {ref_norms}; max param difference {worst:.3g}]")
        assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(norms, ref_norms)), (norms, ref_norms)
        assert worst < TOL, worst


@pytest.mark.parametrize("nan_rank", [0, 3])
def test_a_nan_on_one_stage_skips_the_step_on_every_stage(nan_rank):
    results = multiprocess.run(4, "pipelining_norm_workers.nan_on_one_stage", nan_rank=nan_rank)
    for skipped, unchanged, report in results:
        assert skipped == [False, True, False], skipped
        assert unchanged
        assert "every pipeline stage" in report and "pipeline stage" in report, report


@pytest.mark.parametrize("zero1", [False, True])
def test_a_norm_or_step_over_part_of_the_ranks_chunks_is_refused(zero1):
    messages = multiprocess.run(4, "pipelining_norm_workers.part_of_the_chunks", zero1=zero1)
    call = "DistributedOptimizer.step_together" if zero1 else "grad_norm({chunk0"
    for message in messages:
        assert message is not None and "holds 2 model chunks of the pipeline" in message, message
        assert "but 1 were given" in message, message
        assert call in message, message


@pytest.mark.parametrize("zero1", [False, True])
def test_stages_that_clip_to_other_bounds_are_refused_on_every_rank(zero1):
    messages = multiprocess.run(4, "pipelining_norm_workers.clip_differs", zero1=zero1)
    what = "clip_grad_norm differs across the ranks of the run" if zero1 else "max_norm differs across the ranks"
    for message in messages:
        assert message is not None and what in message, message


def test_a_second_model_on_the_same_mesh_is_not_a_chunk():
    for norm, want in multiprocess.run(4, "pipelining_norm_workers.a_second_model"):
        assert math.isclose(norm, want, rel_tol=1e-6), (norm, want)
