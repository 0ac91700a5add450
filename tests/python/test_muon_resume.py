"""Muon checkpoints (meshddp's format) resumed at other DP x TP sizes: the momentum buffers and
params survive the resharding bit for bit, and the resumed run stays on the uninterrupted curve.
Workers: muon_resume_workers.py."""

import pytest
from multiprocess import run_once

import meshddp.consolidate as consolidate

# fp32 iteration, 5 steps, against the uninterrupted dp 2 x tp 2 run. Resumed at another DP x TP the
# DP sums and the TP split of fc2's matmul round in another order: measured 1.2e-7 (dp 4 x tp 1),
# 1.4e-7 (dp 2 x tp 1), 1.7e-7 (dp 1 x tp 4); through DCP from a dp 2 x tp 1 run, resumed at dp 4:
# 3.7e-7 (the two uninterrupted runs, dp 2 x tp 2 and dp 4 x tp 1, differ by 3.3e-7).
RESUME_TOL = 1e-6
SAVED_AT = (4, 2)  # world size 4: dp 2 x tp 2


def checkpoint_tensors(directory):
    return consolidate.consolidate(directory, optimizer=True)[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 0-5 at dp 2 x tp 2 uninterrupted, and steps 0-3 saved."""
    root = tmp_path_factory.mktemp("muon_tp")
    world, tp = SAVED_AT
    uninterrupted = run_once(world, "muon_resume_workers.muon_tp_resumable", tp=tp, first=0, last=5)[0]
    run_once(world, "muon_resume_workers.muon_tp_resumable", tp=tp, first=0, last=3, save_dir=str(root / "saved"))
    return root, uninterrupted


@pytest.mark.parametrize("world_size,tp", [(4, 1), (2, 1), (4, 4)])
def test_muon_checkpoint_saved_at_dp2_x_tp2_resumes_at_another_tp_size_on_the_uninterrupted_curve(saved, world_size,
                                                                                                     tp):
    root, uninterrupted = saved
    resaved = root / f"resaved_{world_size}_{tp}"
    results = run_once(world_size, "muon_resume_workers.muon_tp_resumable", tp=tp, first=3, last=5,
                       load_dir=str(root / "saved"), resave_dir=str(resaved))
    # The state as the new mesh holds it, saved again: every tensor (params, Muon momentum buffers
    # under "optim/momentum_buffer/", AdamW moments) equal bit for bit to the saved one.
    before, after = checkpoint_tensors(str(root / "saved")), checkpoint_tensors(str(resaved))
    assert sorted(before) == sorted(after), (sorted(before), sorted(after))
    for name in ("fc1.weight", "fc2.weight", "fc3.weight"):
        assert f"optim/momentum_buffer/{name}" in before and f"optim/exp_avg_sq/{name}" not in before, sorted(before)
    assert "optim/exp_avg_sq/embed.weight" in before and "optim/exp_avg_sq/fc1.bias" in before, sorted(before)
    for key in before:
        assert before[key].equal(after[key]), f"dp {world_size // tp} x tp {tp}: '{key}' changed through the load"
    assert before["optim/momentum_buffer/fc2.weight"].abs().max() > 0, "a vacuous test: no Muon momentum was saved"
    for rank, resumed in enumerate(results):
        diff = max((uninterrupted[n] - resumed[n]).abs().max().item() for n in uninterrupted)
        assert diff <= RESUME_TOL, (f"rank {rank}: resumed at dp {world_size // tp} x tp {tp}, the params differ "
                                    f"from the uninterrupted dp 2 x tp 2 run by {diff}")


def assert_same_tensors(before_dir, after_dir, what):
    before, after = checkpoint_tensors(before_dir), checkpoint_tensors(after_dir)
    assert sorted(before) == sorted(after), (sorted(before), sorted(after))
    for key in before:
        assert before[key].equal(after[key]), f"{what}: '{key}' changed"


def test_muon_state_dict_through_dcp_resumes_at_another_dp_size(saved, tmp_path):
    # opt.state_dict() under Muon: each matrix's "momentum_buffer" (torch.optim.Muon's name), AdamW's
    # two moments for the rest.
    _, uninterrupted = saved
    kinds = run_once(2, "muon_resume_workers.save_after", tp=1, steps=3, save_dir=str(tmp_path / "native"),
                     dcp_dir=str(tmp_path / "dcp"))[0]["state kinds"]
    assert kinds["fc1.weight"] == ["momentum_buffer"] and kinds["fc3.weight"] == ["momentum_buffer"], kinds
    assert kinds["embed.weight"] == ["exp_avg", "exp_avg_sq"] and kinds["fc1.bias"] == ["exp_avg", "exp_avg_sq"], kinds
    results = run_once(4, "muon_resume_workers.resume_from_dcp", tp=1, first=3, last=5, dcp_dir=str(tmp_path / "dcp"),
                       resave_dir=str(tmp_path / "resaved"))
    assert_same_tensors(str(tmp_path / "native"), str(tmp_path / "resaved"), "saved at dp 2 by DCP, loaded at dp 4")
    diff = max((uninterrupted[n] - results[0][n]).abs().max().item() for n in uninterrupted)
    assert diff <= RESUME_TOL, f"resumed from DCP at dp 4, the params differ from the uninterrupted run by {diff}"


def test_adamw_checkpoint_under_whole_param_loads_under_byte_range_bit_for_bit(tmp_path):
    # The checkpoint holds global coordinates: the shard policy (which rank owns which elements) is
    # the loader's business.
    run_once(2, "muon_resume_workers.save_after", tp=1, steps=2, save_dir=str(tmp_path / "whole"), kind="adamw")
    errors = run_once(2, "muon_resume_workers.load_into", tp=1, load_dir=str(tmp_path / "whole"),
                      resave_dir=str(tmp_path / "bytes"), kind="adamw", shard_policy="byte_range")
    assert errors == [None, None], errors
    assert_same_tensors(str(tmp_path / "whole"), str(tmp_path / "bytes"), "whole_param -> byte_range")


@pytest.mark.parametrize("saved_kind,loaded_kind", [("adamw", "muon"), ("muon", "adamw")])
def test_a_checkpoint_of_one_kind_is_refused_by_the_other_naming_the_way_out(tmp_path, saved_kind, loaded_kind):
    run_once(2, "muon_resume_workers.save_after", tp=1, steps=1, save_dir=str(tmp_path), kind=saved_kind)
    for rank, message in enumerate(run_once(2, "muon_resume_workers.load_into", tp=1, load_dir=str(tmp_path),
                                            kind=loaded_kind)):
        assert message is not None, f"rank {rank}: a {saved_kind} checkpoint loaded under {loaded_kind}"
        assert f"holds {saved_kind} state but this optimizer is {loaded_kind}" in message, message
        assert f"resume with kind = {saved_kind}" in message and "load the params alone" in message, message


def test_muon_checkpoint_loaded_with_other_muon_adamw_params_is_refused_by_name(tmp_path):
    # Saved with fc3 on Muon; loaded with fc3 on AdamW, its Muon momentum would become AdamW's exp_avg.
    run_once(2, "muon_resume_workers.save_after", tp=1, steps=1, save_dir=str(tmp_path))
    for rank, message in enumerate(run_once(2, "muon_resume_workers.load_into", tp=1, load_dir=str(tmp_path),
                                            muon_adamw_params="*embed*,*lm_head*,fc3*")):
        assert message is not None, f"rank {rank}: loaded with fc3 moved from Muon to AdamW"
        assert "muon_adamw_params = '*embed*,*lm_head*'" in message and "'*embed*,*lm_head*,fc3*'" in message, message
