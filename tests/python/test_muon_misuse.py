"""Muon and whole-param ownership misused: each refused by name (param, rank, expected vs actual, the
way out) before any collective could hang or abort, or handled. Workers: muon_misuse_workers.py."""

import pytest
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


def test_spaces_around_muon_adamw_params_patterns_are_the_lists_not_the_patterns():
    # " *lm_head*" (after ", ") matched no param, and the LM head went to Muon without a word.
    r = run_once(1, "muon_misuse_workers.muon_params_and_warnings", muon_adamw_params=" wte* , *lm_head* ")[0]
    assert r["muon"] == ["fc.weight"], r["muon"]


def test_an_embedding_that_muon_would_take_is_warned_of_naming_it_and_the_fix():
    r = run_once(1, "muon_misuse_workers.muon_params_and_warnings", muon_adamw_params="*embed*,*lm_head*")[0]
    assert r["muon"] == ["wte.weight", "fc.weight"], r["muon"]
    assert len(r["warnings"]) == 1 and "'wte.weight'" in r["warnings"][0], r["warnings"]
    assert "muon_adamw_params='*embed*,*lm_head*,wte.weight'" in r["warnings"][0], r["warnings"][0]
    fixed = run_once(1, "muon_misuse_workers.muon_params_and_warnings", muon_adamw_params="*embed*,*lm_head*,wte*")[0]
    assert fixed["muon"] == ["fc.weight"] and fixed["warnings"] == [], fixed


def test_muon_matrices_hold_one_state_tensor_and_the_adamw_params_two():
    # Per rank: the momentum buffer over the whole shard (state 1, padding included, as the other
    # kinds), AdamW's exp_avg_sq over the AdamW params' elements only (was: over the whole shard too).
    for world_size in (1, 2):
        for rank, r in enumerate(run_once(world_size, "muon_misuse_workers.muon_params_and_warnings",
                                          muon_adamw_params="wte*,lm_head*")):
            shard_bytes = r["memory"]["param_buffer_bytes"] // world_size
            adamw_elements = sum(n for name, n in r["numel"].items() if name not in r["muon"])
            # Every AdamW param is in some rank's shard: this rank's share is at most all of them.
            assert shard_bytes <= r["memory"]["optimizer_state_bytes"] <= shard_bytes + 4 * adamw_elements, (
                f"dp {world_size} rank {rank}: {r['memory']} (AdamW elements {adamw_elements})")
            if world_size == 1:
                assert r["memory"]["optimizer_state_bytes"] == shard_bytes + 4 * adamw_elements, r["memory"]


def test_ranks_with_different_muon_settings_are_refused_on_every_rank_naming_the_field_and_values():
    cases = {"muon_ns_steps": (5, 4), "muon_scale": ("original", "spectral"),
             "muon_adamw_params": ("*embed*,*lm_head*", "wte*,lm_head*")}
    for field, values in cases.items():
        for rank, message in enumerate(run_once(2, "muon_misuse_workers.ranks_with_other_muon_settings", field=field,
                                                values=values)):
            assert message is not None, f"rank {rank}: {field} = {values} accepted"
            assert f"'{field}' is rank 0: " in message and f"{values[1]}" in message, message


@pytest.mark.parametrize("kind", ["muon", "adamw"])
def test_two_optimizer_instances_on_a_1d_mesh_clip_alike_and_stay_replicas(kind):
    # The gradient norm was summed within each instance of a 1-D mesh only: instance 0's ranks saw
    # the whole norm and clipped, instance 1's saw 0 and did not, and the replicas drifted apart.
    results = run_once(4, "muon_misuse_workers.instances_with_clipping", kind=kind)
    for rank, r in enumerate(results):
        assert r["norms"] == results[0]["norms"], f"rank {rank}: grad norms {r['norms']} vs rank 0's {results[0]['norms']}"
        assert r["clipped"] == [True, True, True], f"rank {rank}: clipped {r['clipped']}"
        for a, b in zip(r["params"], results[0]["params"]):
            assert a.equal(b), f"rank {rank}'s params differ from rank 0's by {(a - b).abs().max().item()}"
