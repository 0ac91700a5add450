"""Waiting on peers from Python: a rank stuck on a late peer says so (the C++ meshes' stuck report,
for Python's groups), the GIL is released while the engine waits, and the optimizer finishes its
pending param all-gathers at teardown. Two ranks, Gloo, CPU; short timeouts."""

import re

import torch

import multiprocess


def test_a_rank_waiting_for_a_late_peer_reports_it_naming_the_rank():
    errs = multiprocess.run(2, "a_rank_late_by_one_step")
    waiting = errs[1]
    assert "meshddp: [rank 1 of group" in waiting and "still waiting after" in waiting, waiting
    assert "rank(s) that have not reached it (global ranks): 0" in waiting, waiting
    assert "still waiting" not in errs[0], errs[0]  # rank 0 was the late one: it never waited


def test_a_dead_peer_fails_the_live_ranks_without_reporting_live_peers_behind():
    # Rank 2 dies in step 3; ranks 0 and 1 both launched the bucket. Their errors' "Progress:" line
    # must not list each other (they listed each other "at launch #0": counts published before
    # this launch); the dead rank is listed with its last count, unknown since.
    errors = multiprocess.run(3, "a_peer_dies")
    assert errors[2] is None
    for rank, peer in ((0, 1), (1, 0)):
        text = errors[rank]
        assert "failed or timed out" in text, (rank, text)
        progress = re.search(r"^Progress: (.*)$", text, re.M).group(1)
        assert not re.search(rf"[ ,]{peer} \(", progress), (rank, progress)
        assert ("rank(s) whose progress is unknown (global ranks): 2 (no count published since this rank launched "
                "it; the last, ") in progress, (rank, progress)


def test_python_threads_run_while_forward_waits_for_a_peer():
    rank1 = multiprocess.run(2, "python_runs_while_forward_waits")[1]
    assert rank1["waited"] >= 0.5, rank1  # it did wait for rank 0
    # A thread ticking every 5 ms: ~200 ticks in the second; with the GIL held, ~0.
    assert rank1["ticks"] >= 0.25 * rank1["waited"] / 0.005, rank1


def test_the_optimizer_finishes_pending_param_gathers_at_teardown():
    results = multiprocess.run(2, "zero1_exit_without_finish_param_sync")
    for rank, r in enumerate(results):
        assert r["pending_before"] > 0 and r["pending_after"] == 0, (rank, r["pending_before"], r["pending_after"])
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


def test_python_threads_run_while_the_engine_destructor_waits_for_collectives():
    rank1 = multiprocess.run(2, "python_runs_while_the_engine_is_destroyed")[1]
    assert rank1["waited"] >= 0.5, rank1  # the destructor did wait for the in-flight buckets
    assert rank1["ticks"] >= 0.25 * rank1["waited"] / 0.005, rank1
