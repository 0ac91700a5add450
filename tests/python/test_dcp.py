"""meshddp.DistributedOptimizer.state_dict() / load_state_dict() with torch.distributed.checkpoint:
saved at 2 DP ranks, loaded at 1 and at 4 (Gloo, CPU, spawned processes), training continues; and,
in this process, a fresh optimizer's state dict and the errors on a state dict that does not fit.

Tolerances: resumed from DCP vs resumed from meshddp's own checkpoint format at the same size: the
same state and the same arithmetic, so bit-identical (0). Resumed vs the uninterrupted run at that
size: the first SAVE_AT steps ran at 2 ranks instead of 1 or 4, whose reductions add in another order
(ZeRO-1 vs one-process AdamW differs by <= 3.7e-8 after 10 steps: test_ddp_vs_torch.py). fp32 AdamW:
params and losses within 1e-6 (measured <= 3e-8 and <= 1.2e-7); bf16 SGD: a bf16 param may land one
ulp away (2^-9 at |p| < 0.5: 2e-3), and the losses follow (measured <= 4.9e-4 and <= 1.5e-4).

What the cases check:
- dcp.save({"model": ddp.state_dict(), "optim": opt.state_dict()}) at 2 ranks (AdamW on fp32 params; SGD with
  momentum on bf16 params, fp32 masters; a bias param group; an LR changed mid-run), loaded at 1 and at 4 into
  a model and optimizer built with other values, 4 more steps: bit-identical to resuming from meshddp's own
  format, and within 1e-6 (fp32; measured <= 1.2e-7) / one bf16 ulp (2e-3; measured <= 4.9e-4) of the
  uninterrupted run at that size in params and losses; a fresh optimizer's dict holds every tensor (zeros) and
  round-trips through dcp.save / dcp.load in place; a missing param, a missing state kind and another model's
  sizes are refused naming the param; so are a step that is not an int and a torch.optim optimizer's dict;
  ranks whose dicts differ in step, LR or param groups all fail and none loads (2 ranks); a load after
  backward before finish_grad_sync() is refused; meshddp-consolidate on a DCP directory names
  dcp_to_torch_save
"""

import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

import meshddp
import multiprocess
from dcp_workers import CONTINUE, LR, SAVE_AT, VARIANTS, Net, build, train

TOL = {"adamw_fp32": 1e-6, "sgd_bf16": 2e-3}

_directory = tempfile.TemporaryDirectory()


def saved():
    return multiprocess.run_once(2, "dcp_workers.save", directory=_directory.name)


@pytest.mark.parametrize("world_size", [1, 4])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_saved_at_two_ranks_resumes_at_another_size_as_if_never_stopped(world_size, variant):
    save_losses = saved()[0][variant]
    results = multiprocess.run_once(world_size, "dcp_workers.resume", directory=_directory.name)
    for rank, r in enumerate(results):
        r = r[variant]
        print(f"[{variant} at {world_size}, rank {rank}: vs uninterrupted {r['vs_full']:.3g}, "
              f"vs meshddp format {r['vs_own']:.3g}, losses {r['dcp_losses']} vs {r['full_losses'][SAVE_AT:]}]")
        assert r["loaded"] == {"steps_taken": SAVE_AT, "lr": LR / 2, "bias_wd": 0.0}, r["loaded"]
        assert r["vs_own"] == 0.0, f"rank {rank}: DCP and meshddp's own format resume differently: {r['vs_own']}"
        assert r["dcp_losses"] == r["own_losses"]
        assert r["vs_full"] <= TOL[variant], f"rank {rank}: params differ from the uninterrupted run by {r['vs_full']}"
        assert len(r["dcp_losses"]) == CONTINUE
        for a, b in zip(save_losses + r["dcp_losses"], r["full_losses"]):
            assert abs(a - b) <= TOL[variant], (save_losses + r["dcp_losses"], r["full_losses"])


def test_a_fresh_optimizer_state_dict_holds_every_tensor_and_round_trips(mesh, tmp_path):
    ddp, opt = build(1, 0, "adamw_fp32")
    fresh = opt.state_dict()
    names = [n for n, _ in ddp.named_parameters()]
    assert sorted(fresh["state"]) == sorted(names)
    for name, p in ddp.named_parameters():
        assert set(fresh["state"][name]) == {"exp_avg", "exp_avg_sq"}
        for t in fresh["state"][name].values():
            assert tuple(t.size()) == (p.numel(),) and t.local_shards()[0].tensor.abs().max().item() == 0.0
    assert fresh["step"].item() == 0
    train(ddp, opt, 0, 1, range(3))
    dcp.save({"model": ddp.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(tmp_path))
    saved_state = {(n, k): t.local_shards()[0].tensor.clone() for n, d in opt.state_dict()["state"].items()
                   for k, t in d.items()}

    ddp2, opt2 = build(1, 1, "adamw_fp32")
    sd = {"model": ddp2.state_dict(), "optim": opt2.state_dict()}
    dcp.load(sd, checkpoint_id=str(tmp_path))  # in place: the optimizer's own tensors
    for (n, k), t in saved_state.items():
        assert torch.equal(opt2.state_dict()["state"][n][k].local_shards()[0].tensor, t), (n, k)
    ddp2.load_state_dict(sd["model"])
    opt2.load_state_dict(sd["optim"])
    assert opt2.steps_taken == 3 and opt2._impl.lr() == LR / 2
    # Applying a state dict without DCP (same DP size) copies it in.
    ddp3, opt3 = build(1, 2, "adamw_fp32")
    ddp3.load_state_dict(ddp.state_dict())
    opt3.load_state_dict(opt.state_dict())
    losses = [train(d, o, 0, 1, range(3, 5)) for d, o in ((ddp, opt), (ddp2, opt2), (ddp3, opt3))]
    assert losses[0] == losses[1] == losses[2], losses


def test_a_state_dict_that_does_not_fit_is_refused_naming_the_parameter(mesh):
    ddp, opt = build(1, 0, "adamw_fp32")
    sd = opt.state_dict()
    del sd["state"]["hidden.weight"]
    with pytest.raises(RuntimeError, match=r"load_state_dict: .*missing \['hidden.weight'\]"):
        opt.load_state_dict(sd)

    sd = opt.state_dict()
    del sd["state"]["out.bias"]["exp_avg_sq"]
    with pytest.raises(RuntimeError, match="parameter 'out.bias' has no 'exp_avg_sq' state"):
        opt.load_state_dict(sd)

    # Another model: hidden is 16 x 12 there.
    torch.manual_seed(0)
    other = Net()
    other.hidden = torch.nn.Linear(16, 12)
    other.out = torch.nn.Linear(12, 8)
    other_ddp = meshddp.DistributedDataParallel(other, mesh, config=meshddp.DdpConfig(use_distributed_optimizer=True))
    other_opt = meshddp.DistributedOptimizer(other_ddp, meshddp.DistributedOptimizerConfig(groups=[("*.bias", None, 0.0)]))
    with pytest.raises(RuntimeError, match=r"parameter 'out.weight' 'exp_avg' has 96 elements in the state dict "
                                           r"but 128 in this model"):
        opt.load_state_dict(other_opt.state_dict())

    sd = opt.state_dict()
    sd["param_groups"][1]["weight_decay"] = None
    with pytest.raises(RuntimeError, match=r"param_groups\[1\]\['weight_decay'\] must be a finite number >= 0, got None"):
        opt.load_state_dict(sd)

    for bad in (3.7, True, "5", torch.tensor(2.0), torch.tensor([1, 2])):  # each was read as some int before
        sd = opt.state_dict()
        sd["step"] = bad
        with pytest.raises(RuntimeError, match="step must be an int >= 0 or a one-element integer tensor"):
            opt.load_state_dict(sd)
    sd = opt.state_dict()
    sd["lr"] = True
    with pytest.raises(RuntimeError, match="lr must be a finite number >= 0, got True"):
        opt.load_state_dict(sd)

    model = Net()
    torch_opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    torch_opt.step()
    with pytest.raises(RuntimeError, match="this is a torch.optim optimizer's state_dict()"):
        opt.load_state_dict(torch_opt.state_dict())

    sgd_ddp, sgd_opt = build(1, 0, "sgd_bf16")
    with pytest.raises(RuntimeError, match="parameter '.*' has no 'master' state"):
        sgd_opt.load_state_dict(opt.state_dict())
    assert opt.steps_taken == 0  # nothing was applied


def test_a_bf16_checkpoint_read_into_an_fp32_model_is_refused_naming_each_param(mesh, tmp_path):
    """dcp.load casts the saved bf16 params into an fp32 model's silently, and an fp32 optimizer's dict has
    no "master" for the saved fp32 masters: training on would start from the bf16 values widened. Refused
    by load_state_dict (sync and async saves alike: the same files), naming each param and the way out;
    the same model cast to bf16 loads."""
    ddp, opt = build(1, 0, "sgd_bf16")
    train(ddp, opt, 0, 1, range(2))
    path = str(tmp_path / "bf16")
    dcp.save({"model": ddp.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(1)
        model = Net().to(dtype)
        other = meshddp.DistributedDataParallel(model, init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)),
                                                config=meshddp.DdpConfig(bucket_bytes=1024,
                                                                         use_distributed_optimizer=True))
        other_opt = meshddp.DistributedOptimizer(other, meshddp.DistributedOptimizerConfig(
            kind="sgd", lr=LR, momentum=0.9, weight_decay=0.01, groups=[("*.bias", None, 0.0)]))
        sd = {"model": other.state_dict(), "optim": other_opt.state_dict()}
        dcp.load(sd, checkpoint_id=path)
        other.load_state_dict(sd["model"])
        if dtype == torch.float32:
            with pytest.raises(RuntimeError, match=r"load_state_dict: the model's dtypes differ from the checkpoint's: "
                                                   r"'out.bias' is bfloat16 in the checkpoint but float32 here; .*"
                                                   r"'embed.weight' is bfloat16 in the checkpoint but float32 here\. "
                                                   r"The checkpoint's "
                                                   r"fp32 master weights of the low-precision params would be "
                                                   r"dropped.*Cast the model to the dtype it was saved in"):
                other_opt.load_state_dict(sd["optim"])
            assert other_opt.steps_taken == 0
        else:
            other_opt.load_state_dict(sd["optim"])
            assert other_opt.steps_taken == 2
    assert sd["optim"]["param_dtypes"]["embed.weight"] == "bfloat16"


def test_with_tp_the_state_keys_name_the_tp_rank_and_reshard_over_dp():
    """Saved at 2 (DP) x 2 (TP), loaded at 1 x 2: the same params as a resume from meshddp's format."""
    keys = multiprocess.run_once(4, "dcp_workers.tp_save", directory=_directory.name)
    assert "fc1.weight@tp0of2" in keys[0] and "fc1.weight@tp1of2" in keys[1] and "norm.weight@tp1of2" in keys[3]
    for rank, diff in enumerate(multiprocess.run_once(2, "dcp_workers.tp_resume", directory=_directory.name)):
        assert diff == 0.0, f"rank {rank}: resumed from DCP differs from meshddp's format by {diff}"


def test_when_one_rank_refuses_the_state_dict_every_rank_fails_and_none_loads():
    errors = multiprocess.run_once(2, "dcp_workers.one_rank_refuses")
    assert "missing ['out.weight']" in errors[1], errors
    assert "another rank found the state dict unusable" in errors[0], errors


@pytest.mark.parametrize("field", ["step", "lr", "param_groups"])
def test_ranks_whose_state_dicts_disagree_all_fail_and_none_loads(field):
    """A step count or learning rate that differs between ranks (each read another checkpoint) would
    train on silently with each rank's shard updated by other settings."""
    results = multiprocess.run_once(2, "dcp_workers.ranks_disagree", field=field)
    for rank, r in enumerate(results):
        assert r is not None, f"rank {rank} loaded a state dict the other rank disagrees with"
        assert f"the ranks' state dicts differ in {field}" in r["error"], r["error"]
        assert r["steps_taken"] == 3 and r["lr"] == LR / 2 and r["bias_wd"] == 0.0, r  # nothing applied


def test_load_state_dict_while_a_gradient_sync_is_pending_is_refused(mesh):
    """After backward and before finish_grad_sync(): the loaded params would get the gradients of the
    old ones (ddp.load_state_dict refuses the same)."""
    ddp, opt = build(1, 0, "adamw_fp32")
    train(ddp, opt, 0, 1, range(2))
    sd = opt.state_dict()
    ddp.zero_grad_buffer()
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    with pytest.raises(RuntimeError, match=r"DistributedOptimizer.load_state_dict: .*finish_grad_sync\(\)"):
        opt.load_state_dict(sd)
    assert opt.steps_taken == 2
    ddp.finish_grad_sync()
    opt.load_state_dict(sd)  # between steps it loads


def test_meshddp_consolidate_pointed_at_a_dcp_checkpoint_says_how_to_read_one(mesh, tmp_path):
    """It reads meshddp's own format; a DCP directory (files and .metadata) was 'no complete checkpoint'."""
    from meshddp import consolidate

    ddp, opt = build(1, 0, "adamw_fp32")
    dcp.save({"model": ddp.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
    with pytest.raises(consolidate.CheckpointError, match=r"is a torch.distributed.checkpoint \(DCP\) directory "
                                                          r".*dcp_to_torch_save"):
        consolidate.consolidate(str(tmp_path / "dcp"))


def test_dcp_async_save_of_ddp_and_optimizer_state_dicts_resumes_as_the_sync_save_does(tmp_path):
    """torch.distributed.checkpoint.async_save with ddp.state_dict() / opt.state_dict() at 2 ranks, on
    a Gloo group made for it, staged by meshddp.DcpStager, training on during the write: resumes exactly as dcp.save of the same
    step does, and both equal the uninterrupted run (the same size: bit for bit)."""
    results = multiprocess.run(2, "dcp_workers.async_save", directory=str(tmp_path))
    for rank, r in enumerate(results):
        for variant, v in r.items():
            print(f"[{variant} rank {rank}: async vs uninterrupted {v['async_vs_full']}, sync {v['sync_vs_full']}]")
            assert v["async_losses"] == v["sync_losses"] == v["full_losses"], (variant, rank, v)
            assert v["async_vs_full"] == 0.0 and v["sync_vs_full"] == 0.0, (variant, rank, v)


def test_dcp_async_save_staged_by_dcp_stager_of_a_torch_tp_model_resumes_bit_for_bit(tmp_path):
    """dp 2 x tp 2, DTensor params (torch TP) under ZeRO-1: meshddp.DcpStager stages the DTensors as
    DTensors (their local shards copied to host memory), training goes on during the write, and the resume
    equals the uninterrupted run (the same size, the same arithmetic: 0)."""
    for rank, diff in enumerate(multiprocess.run(4, "dcp_workers.tp_async_save", directory=str(tmp_path))):
        assert diff == 0.0, f"rank {rank}: resumed from the async save differs from the uninterrupted run by {diff}"


def test_an_async_save_in_meshddps_format_commits_at_a_step_boundary_and_resumes_bit_for_bit(tmp_path):
    """DistributedOptimizer.save_checkpoint(async_save=True) at 2 ranks: committed at a later
    checkpoint_step_boundary() (or wait_checkpoint()), `latest` moved; resumes to the uninterrupted
    params exactly, as the sync save of the same step does."""
    results = multiprocess.run(2, "dcp_workers.meshddp_async_save", directory=str(tmp_path))
    for rank, r in enumerate(results):
        print(f"[rank {rank}: started {r['started']}, reports {r['reports']}]")
        assert r["started"]["path"] == str(tmp_path / "async" / f"step-{SAVE_AT}")
        assert r["reports"][-1] == ("committed", r["started"]["path"]), r["reports"]
        assert r["sync_vs_full"] == 0.0 and r["async_vs_full"] == 0.0, r
    assert (tmp_path / "async" / "latest").read_text() == f"step-{SAVE_AT}\n"
