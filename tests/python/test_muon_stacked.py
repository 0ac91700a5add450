"""Muon on stacked matrices (OptimizerConfig.muon_stacked_matrices): the MoE's experts, two 3-D params
w1 [E, d, h] and w2 [E, h, d], stepped by meshddp.DistributedOptimizer(kind="muon") at dp 2 and dp 4
(plain 3-D params, and torchtitan-style DTensor experts Shard(0) over EP 2) against one process where
every expert matrix is a separate 2-D param (torch.optim.Muon accepts only those); checkpoints at
another DP size, the refusals. Workers: muon_stacked_workers.py."""

import re

import pytest
import torch
from multiprocess import run_once

# fp32 iteration against the same ops in one process: the DP sums' rounding only. Measured (4 steps;
# the max over ranks at dp 2 / dp 4 / dp 4 x EP 2): experts 1.2e-7 / 8.9e-8 / 1.2e-7, router and head
# 1.1e-6 / 1.6e-6 / 9.9e-7, AdamW params 1.5e-8 / 2.2e-8 / 7.5e-9; the experts moved 0.051.
EXPERT_TOL, MATRIX_TOL, ADAMW_TOL = 1e-6, 5e-6, 1e-7
# bf16 iteration against torch.optim.Muon (dp 2): a bf16 rounding of the update flips where the DP-mean
# gradient differs from the one-process one in its last fp32 bits, as in test_muon.py. Measured:
# experts 3.4e-4, router and head 7.0e-4, AdamW params 3.2e-6.
BF16_TOL, BF16_ADAMW_TOL = 2e-3, 1e-5
# Saved at dp 4 after 2 steps, resumed at dp 2 for 2 more, against 4 steps at dp 4: measured 9.7e-7.
RESUME_TOL = 5e-6
MUON_PARAMS = ["w1", "w2", "router.weight", "head.weight"]  # the engine's order


@pytest.mark.parametrize("world_size,ep", [(2, 1), (4, 1), (4, 2)])
def test_fp32_iteration_on_each_expert_matrix_matches_separate_matrices_in_one_process(world_size, ep):
    for rank, r in enumerate(run_once(world_size, "muon_stacked_workers.stacked_vs_one_process", ep=ep)):
        assert r["expert_diff"] <= EXPERT_TOL, f"rank {rank}: the experts differ by {r['expert_diff']}"
        assert r["matrix_diff"] <= MATRIX_TOL, f"rank {rank}: router and head differ by {r['matrix_diff']}"
        assert r["adamw_diff"] <= ADAMW_TOL, f"rank {rank}: the AdamW params differ by {r['adamw_diff']}"
        assert r["moved"] > 1000 * EXPERT_TOL, f"rank {rank}: the experts barely moved ({r['moved']}): a vacuous test"
        assert r["muon_params"] == MUON_PARAMS, r["muon_params"]
        if ep == 1:
            assert r["w1_state"] == ["momentum_buffer"], r["w1_state"]


def test_bf16_iteration_matches_torch_muon_on_separate_matrices():
    for rank, r in enumerate(run_once(2, "muon_stacked_workers.stacked_vs_one_process", ns_dtype="bf16")):
        assert r["expert_diff"] <= BF16_TOL, f"rank {rank}: the experts differ from torch.optim.Muon's by {r['expert_diff']}"
        assert r["matrix_diff"] <= BF16_TOL, f"rank {rank}: router and head differ by {r['matrix_diff']}"
        assert r["adamw_diff"] <= BF16_ADAMW_TOL, f"rank {rank}: the AdamW params differ by {r['adamw_diff']}"
        assert r["moved"] > 10 * BF16_TOL, f"rank {rank}: the experts barely moved ({r['moved']})"


def test_default_off_keeps_3d_params_on_adamw():
    for rank, r in enumerate(run_once(2, "muon_stacked_workers.stacked_vs_one_process", stacked=False)):
        assert r["muon_params"] == MUON_PARAMS[2:], r["muon_params"]
        assert r["w1_state"] == ["exp_avg", "exp_avg_sq"], r["w1_state"]
        # Measured: experts 6.0e-8 from torch.optim.AdamW's (router and head 1.5e-6, as above).
        assert r["expert_diff"] <= ADAMW_TOL, f"rank {rank}: the experts differ from torch AdamW's by {r['expert_diff']}"
        assert r["matrix_diff"] <= MATRIX_TOL and r["adamw_diff"] <= ADAMW_TOL, r


def test_checkpoint_saved_at_dp4_resumes_at_dp2_on_the_uninterrupted_curve(tmp_path):
    uninterrupted = run_once(4, "muon_stacked_workers.stacked_resumable", first=0, last=4)[0]
    run_once(4, "muon_stacked_workers.stacked_resumable", first=0, last=2, save_dir=str(tmp_path))
    for rank, resumed in enumerate(run_once(2, "muon_stacked_workers.stacked_resumable", first=2, last=4,
                                            load_dir=str(tmp_path))):
        assert isinstance(resumed, dict), f"rank {rank}: the load failed: {resumed}"
        diff = max((uninterrupted[n] - resumed[n]).abs().max().item() for n in uninterrupted)
        assert diff <= RESUME_TOL, f"rank {rank}: resumed at dp 2, params differ from the uninterrupted run by {diff}"
    # Loaded with the setting off, the experts would take AdamW's state from Muon's momentum buffer.
    for rank, message in enumerate(run_once(2, "muon_stacked_workers.stacked_resumable", first=2, last=4,
                                            load_dir=str(tmp_path), stacked=False)):
        assert isinstance(message, str), f"rank {rank}: loaded a muon_stacked_matrices checkpoint with it off"
        assert "saved with muon_stacked_matrices = true" in message, message
        assert "this optimizer has muon_stacked_matrices = false" in message, message


@pytest.mark.parametrize("dim", [1, 2])
def test_a_stack_sharded_over_tp_is_refused_by_name(dim):
    for message in run_once(2, "muon_stacked_workers.tp_sharded_stack_refused", dim=dim):
        assert message is not None and "muon_stacked_matrices" in message and "'w'" in message, message
        assert f"Shard({dim})" in message and "muon_adamw_params" in message, message


def test_the_setting_is_agreed_over_the_mesh():
    for rank, message in enumerate(run_once(2, "muon_stacked_workers.settings_differ")):
        assert message is not None and "'muon_stacked_matrices' is rank 0: false, rank 1: true" in message, \
            f"rank {rank}: {message}"


def test_a_conv1d_kernel_that_stacked_muon_would_take_is_warned_of_naming_it_and_the_fix():
    # An nn.Conv1d weight [out, in, k] is 3-D: unnamed in muon_adamw_params, it would be stepped as out
    # separate in x k matrices.
    r = run_once(1, "muon_stacked_workers.conv_kernel_warnings", muon_adamw_params="*embed*")[0]
    assert sorted(r["muon"]) == ["conv.weight", "experts"], r["muon"]
    assert len(r["warnings"]) == 1 and "'conv.weight' (Conv1d, [6, 4, 3])" in r["warnings"][0], r["warnings"]
    assert "muon_adamw_params='*embed*,conv.weight'" in r["warnings"][0], r["warnings"][0]
    fixed = run_once(1, "muon_stacked_workers.conv_kernel_warnings", muon_adamw_params="*embed*,conv*")[0]
    assert fixed["muon"] == ["experts"] and fixed["warnings"] == [], fixed


@pytest.mark.parametrize("kind", ["muon", "adamw"])
def test_an_empty_stack_trains_beside_the_others(kind):
    # A param of no elements ([0, 4, 6]: a stack of no experts) was reported as replaced after wrapping
    # (its data pointer is not its slot's) at the first step; it has nothing to update.
    with_empty = run_once(2, "muon_stacked_workers.steps_beside_an_empty_stack", kind=kind, with_empty=True)
    without = run_once(2, "muon_stacked_workers.steps_beside_an_empty_stack", kind=kind, with_empty=False)
    for rank, (a, b) in enumerate(zip(with_empty, without)):
        assert isinstance(a, torch.Tensor), f"rank {rank}: {a}"
        assert torch.equal(a, b), f"rank {rank}: the experts differ by {(a - b).abs().max().item()}"


@pytest.mark.parametrize("saved_stacked", [True, False])
def test_a_state_dict_loaded_with_the_setting_flipped_names_the_settings(saved_stacked):
    # The experts hold Muon's momentum_buffer with the setting on, AdamW's moments with it off.
    for message in run_once(1, "muon_stacked_workers.state_dict_loaded_with_the_setting_flipped",
                            saved_stacked=saved_stacked):
        assert message is not None and re.search(r"parameter 'w[12]' has no '", message), message
        assert f"muon_stacked_matrices={not saved_stacked}" in message, message
        assert "load with the muon_adamw_params and muon_stacked_matrices it was saved with" in message, message
