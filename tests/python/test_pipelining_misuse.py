"""meshddp.pipelining.PipelineStage misused (pipelining_misuse_workers.py, dp 2 x pp 2 on 4 Gloo
processes): each a named RuntimeError on the ranks concerned, never a hang. And the V-shaped schedules
(ScheduleZBVZeroBubble, ScheduleDualPipeV) on one Gloo rank: torch's own stage fails in its warm-up
send/recv to the stage on its own rank (Gloo has no pair from a rank to itself, pytorch/gloo#344),
meshddp's stage leaves those sends out and matches one process.

What the cases check:
- micro-batch counts or grad_reduction differing across DP ranks, an optimizer step before every chunk
  finished its sync: named errors on every rank; V-shaped schedules on one Gloo rank: torch's stage fails
  (Pair is not connected), meshddp's runs
"""

import pytest

import multiprocess


def test_a_micro_batch_count_that_differs_across_dp_ranks_is_named_on_every_rank():
    messages = multiprocess.run(4, "pipelining_misuse_workers.microbatches_differ")
    assert all(m is not None and "micro-batch count (n_microbatches) differs across the stage's DP ranks" in m
               for m in messages), messages
    assert "rank 0: 4, rank 2: 2" in messages[0] and "rank 1: 4, rank 3: 2" in messages[1], messages


def test_a_grad_reduction_that_differs_across_dp_ranks_is_named_on_every_rank():
    messages = multiprocess.run(4, "pipelining_misuse_workers.grad_reduction_differs")
    assert all(m is not None and "grad_reduction differs across the stage's DP ranks" in m for m in messages), messages
    assert "rank 0: 'mean', rank 2: 'sum'" in messages[0] and "rank 1: 'mean', rank 3: 'sum'" in messages[1], messages


@pytest.mark.parametrize("schedule,finished", [("1F1B", 0), ("Interleaved1F1B", 1)])
def test_an_optimizer_step_before_every_chunk_finished_its_sync_is_refused(schedule, finished):
    """1F1B: no finish_grad_sync at all; Interleaved1F1B: only the rank's first chunk finished; the
    message names the unfinished chunk's params (a DistributedDataParallel of the second chunk)."""
    messages = multiprocess.run(4, "pipelining_misuse_workers.step_before_finish", schedule=schedule,
                                finished=finished)
    for rank, m in enumerate(messages):
        assert m is not None and "SGD.step() was called while this step's gradient sync is still running" in m, m
        assert "meshddp.pipelining.finalize_model_grads(stages)" in m and "'0.fc.weight'" in m, m


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
def test_v_shaped_schedules_on_gloo_fail_in_torchs_stage_and_run_in_meshddps(schedule):
    theirs = multiprocess.run(1, "pipelining_misuse_workers.v_shaped_on_one_rank", schedule=schedule,
                              meshddp_stage=False)
    assert theirs[0] is not None and "Pair is not connected" in theirs[0], theirs
    ours = multiprocess.run(1, "pipelining_misuse_workers.v_shaped_on_one_rank", schedule=schedule,
                            meshddp_stage=True)
    assert ours == [None], ours


# Note [torch's stage methods this stage overrides] (meshddp/pipelining.py): checked at import.
def test_every_torch_stage_method_it_overrides_has_the_signature_it_was_written_for():
    from torch.distributed.pipelining import PipelineStage as TorchStage

    import meshddp.pipelining as pipelining

    pipelining._check_torch_stage()  # the running torch
    # __init__ passes everything but grad_reduction through to torch's.
    overridden = {n for n, v in vars(pipelining.PipelineStage).items()
                  if callable(v) and hasattr(TorchStage, n) and n != "__init__"}
    assert overridden == set(pipelining._WRITTEN_FOR), "an override missing from _WRITTEN_FOR, or one listed in vain"


def _defining_class(name):
    from torch.distributed.pipelining import PipelineStage as TorchStage

    return next(c for c in TorchStage.__mro__ if name in vars(c))


def test_a_torch_stage_method_of_another_signature_is_refused_naming_it(monkeypatch):
    import meshddp.pipelining as pipelining

    monkeypatch.setattr(_defining_class("scale_grads"), "scale_grads", lambda self, factor, stage=None: None)
    with pytest.raises(ImportError, match=r"torch .*'s PipelineStage\.scale_grads is scale_grads\(self, factor, "
                                          r"stage=None\), but meshddp's stage overrides it as written for "
                                          r"scale_grads\(self, grad_scale_factor\) \(torch 2\.11\)"):
        pipelining._check_torch_stage()


def test_a_torch_autograd_engine_entry_of_another_signature_is_refused_naming_it(monkeypatch):
    # The weight pass of a split backward runs the engine as torch.autograd.backward does (a compiled stage's
    # node has no metadata for backward()'s shape check): a changed entry point is named at import.
    import meshddp.pipelining as pipelining

    monkeypatch.setattr(pipelining, "_engine_run_backward", lambda t_outputs, grad_tensors: None)
    with pytest.raises(ImportError, match=r"torch\.autograd\.graph\._engine_run_backward is "
                                          r"_engine_run_backward\(t_outputs, grad_tensors\), but meshddp's stage calls "
                                          r"it as torch\.autograd\.backward does"):
        pipelining._check_torch_stage()


def test_importing_it_over_a_torch_stage_that_lacks_a_method_fails_naming_it():
    import subprocess
    import sys

    code = ("from torch.distributed.pipelining import PipelineStage as S\n"
            "delattr(next(c for c in S.__mro__ if '_prepare_backward_infra' in vars(c)), '_prepare_backward_infra')\n"
            "import meshddp.pipelining\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0, out.stdout + out.stderr
    assert "ImportError: meshddp.pipelining: torch" in out.stderr, out.stderr
    assert "PipelineStage._prepare_backward_infra is missing, but meshddp's stage overrides it" in out.stderr, out.stderr
