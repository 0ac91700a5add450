"""Muon and whole-param ownership misused: each refused by name (param, rank, expected vs actual, the
way out) before any collective could hang or abort, or handled. Workers: muon_misuse_workers.py."""

from multiprocess import run_once


def test_uneven_tp_pieces_of_a_muon_matrix_are_refused_naming_the_param_and_each_ranks_piece():
    # 63 rows over TP 2: 32 and 31. The whole-matrix all-gather would get pieces of two sizes (Gloo
    # aborted the process: "Received data size doesn't match expected size").
    for rank, message in enumerate(run_once(2, "muon_misuse_workers.uneven_tp_pieces", rows=63)):
        assert message is not None, f"rank {rank}: uneven TP pieces accepted"
        assert "Muon matrix 'w'" in message and "rank 0: 32 x 32, rank 1: 31 x 32" in message, message
        assert "muon_adamw_params" in message and "divides" in message, message
    # Even pieces (64 rows), and uneven ones under AdamW (elementwise: no gather), train.
    assert run_once(2, "muon_misuse_workers.uneven_tp_pieces", rows=64) == [None, None]
    assert run_once(2, "muon_misuse_workers.uneven_tp_pieces", rows=63, kind="adamw") == [None, None]
