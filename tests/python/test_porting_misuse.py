"""What a trainer ported from torch or Megatron-core does with meshddp's Python surface that would
otherwise be ignored without a word: param_groups of the DistributedOptimizer edited the torch way
(a param moved or dropped, a group appended, betas or momentum set), a torch optimizer over bf16
params whose gradients are reduced in fp32 (.grad None), torch's clip_grad_norm_ keywords. Each is
refused naming the param or the key and the way out, with nothing changed. One rank, in this process.

What the cases check:
- one rank: edits of the DistributedOptimizer's param_groups that step() would ignore (a param moved to a
  group with LR 0, a group appended, betas / eps / momentum / nesterov set) refused naming the group, the
  param or the key, params unchanged, and fine once undone; equal values and a scheduler's initial_lr
  accepted; torch AdamW over bf16 params with grad_reduce_in_fp32 refused naming the param (before: nothing
  changed, no error), then stepping after p.grad = p.main_grad.to(p.dtype); clip_grad_norm_(..., foreach=True)
  accepted (before: TypeError); meshddp.DcpStager staging a second save while the first one's copy is still
  held keeps the first intact (before: overwritten with the second's values, 0.weight off by 1.0) and warns,
  and saves waited for reuse one set of host buffers; ZeRO-1 step() after finish_grad_sync() then
  scale_gradients(0.25) or finalize_model_grads(num_tokens=4) steps on the scaled gradient (SGD vs torch on
  the same batch, within 1e-7; before: refused, blaming torch's clip_grad_norm_), while torch's
  clip_grad_norm_ after them is still refused; torch's SGD over a ZeRO-1 wrapper refused naming the param,
  params unchanged; LrScheduler.attach of an optimizer already attached says so (before: the optimizer's
  default lr is 0.0, the warm-up's LR the first attach had set); 2 ranks (porting_workers.py):
  torch.amp.GradScaler over ZeRO-1 with an inf in rank 1's local gradient skips the step on both ranks (params
  unchanged, scale halved on both), then a clean step matches torch SGD on the mean gradient within 1e-3
  (bf16-compressed reduce-scatter; measured 3.7e-4); before: a hang. Each seen failing without its check (14
  of 15 cases; the accepted-values case passes both ways)
"""

import pytest
import torch

import meshddp


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def zero1(mesh, groups=()):
    m = model()
    ddp = meshddp.DistributedDataParallel(m, mesh, config=meshddp.DdpConfig(use_distributed_optimizer=True))
    opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(lr=0.1, groups=list(groups)))
    ddp.zero_grad_buffer()
    ddp(torch.randn(3, 4)).sum().backward()
    return m, ddp, opt


def snapshot(m):
    return [p.detach().clone() for p in m.parameters()]


def unchanged(m, before):
    return all(torch.equal(p, b) for p, b in zip(m.parameters(), before))


def test_a_param_moved_between_param_groups_is_refused_naming_it(mesh):
    # Before: step() kept updating '0.weight' with group 0's lr 0.1, though the user moved it into a group
    # whose lr is 0 (and a param dropped from every group kept training).
    m, ddp, opt = zero1(mesh, [("*.bias", None, 0.0)])
    before = snapshot(m)
    opt.param_groups[1]["lr"] = 0.0
    opt.param_groups[1]["params"].append(opt.param_groups[0]["params"].pop(0))
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\] was changed \(param '0.weight' was "
                                           r"removed from it\).*OptimizerConfig\(groups="):
        opt.step()
    assert unchanged(m, before)
    opt.param_groups[1]["params"].pop()
    opt.param_groups[0]["params"].insert(0, m[0].weight)
    opt.step()  # as built again: fine
    assert not unchanged(m, before)


def test_a_param_group_appended_to_param_groups_is_refused(mesh):
    m, ddp, opt = zero1(mesh)
    before = snapshot(m)
    bias = [p for p in opt.param_groups[0]["params"] if p.dim() == 1]
    opt.param_groups[0]["params"] = [p for p in opt.param_groups[0]["params"] if p.dim() != 1]
    opt.param_groups.append({"params": bias, "lr": 0.0, "weight_decay": 0.0})
    with pytest.raises(RuntimeError, match=r"param_groups has 2 groups, but the optimizer was built with 1"):
        opt.step()
    assert unchanged(m, before)


@pytest.mark.parametrize("key, value, message", [
    ("betas", (0.0, 0.0), r"param_groups\[0\]\['betas'\] is \(0.0, 0.0\).*OptimizerConfig \(\(0.9, 0.999\)\)"),
    ("eps", 1.0, r"param_groups\[0\]\['eps'\] is 1.0"),
    ("momentum", 0.9, r"param_groups\[0\]\['momentum'\] is 0.9"),
    ("nesterov", True, r"param_groups\[0\]\['nesterov'\] is True.*does not do this"),
])
def test_a_torch_hyperparameter_set_in_param_groups_is_refused_naming_it(mesh, key, value, message):
    # Before: ignored; step() used OptimizerConfig's betas, eps and momentum.
    m, ddp, opt = zero1(mesh)
    before = snapshot(m)
    opt.param_groups[0][key] = value
    with pytest.raises(RuntimeError, match=message):
        opt.step()
    assert unchanged(m, before)


def test_torch_hyperparameters_equal_to_the_config_and_scheduler_keys_are_accepted(mesh):
    m, ddp, opt = zero1(mesh)
    opt.param_groups[0].update(betas=[0.9, 0.999], eps=1e-8, nesterov=False)
    torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)  # adds 'initial_lr'
    opt.step()


def test_a_torch_optimizer_over_bf16_params_reduced_in_fp32_is_refused_naming_the_param(mesh):
    # Before: .grad is None for every param (the gradient is the fp32 main_grad), AdamW skipped them all:
    # no param changed, no error, at every step.
    m = model().to(torch.bfloat16)
    ddp = meshddp.DistributedDataParallel(m, mesh, config=meshddp.DdpConfig(grad_reduce_in_fp32=True))
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.1)
    ddp.zero_grad_buffer()
    ddp(torch.randn(3, 4, dtype=torch.bfloat16)).float().sum().backward()
    ddp.finish_grad_sync()
    before = snapshot(m)
    with pytest.raises(RuntimeError, match=r"AdamW.step\(\) would skip parameter '0.weight': it is torch.bfloat16 "
                                           r"and its gradient is reduced in fp32.*p.grad = p.main_grad.to\(p.dtype\)"):
        opt.step()
    assert unchanged(m, before)
    for p in m.parameters():
        p.grad = p.main_grad.to(p.dtype)  # the way out the message gives
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(m.parameters(), before))


def test_clip_grad_norm_takes_torchs_foreach_keyword(mesh):
    # Before: TypeError: clip_grad_norm_() got an unexpected keyword argument 'foreach'.
    m = model()
    ddp = meshddp.DistributedDataParallel(m, mesh)
    ddp.zero_grad_buffer()
    ddp(torch.randn(3, 4)).sum().backward()
    norm = meshddp.grad_norm(ddp)
    assert meshddp.clip_grad_norm_(ddp, 0.5, foreach=True).item() == pytest.approx(norm, rel=1e-12)
    assert meshddp.grad_norm(ddp) == pytest.approx(0.5, rel=1e-5)


def test_dcp_stager_never_overwrites_a_save_its_writer_still_holds(mesh, tmp_path):
    # Before: the second stage() copied into the host buffers the first save's writer was still writing:
    # the first checkpoint got the second's values (0.weight off by 1.0), committed by DCP as valid.
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    m, ddp, opt = zero1(mesh)
    ddp.finish_grad_sync()
    stager = meshddp.DcpStager()
    first = stager.stage({"model": ddp.state_dict(), "optim": opt.state_dict()})  # as DCP's writer holds it
    expected = first["model"]["0.weight"].clone()
    with torch.no_grad():
        m[0].weight.add_(1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = stager.stage({"model": ddp.state_dict(), "optim": opt.state_dict()})
    assert torch.equal(first["model"]["0.weight"], expected)
    assert torch.equal(second["model"]["0.weight"], expected + 1.0)
    assert any("DcpStager: a checkpoint was staged while the previous one is still held" in str(w.message)
               for w in caught)
    del first, second
    # Saves waited for (future.result()) reuse one set of host buffers, without a warning.
    side = dist.new_group(backend="gloo")
    ptrs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            sd = {"model": ddp.state_dict(), "optim": opt.state_dict()}
            dcp.async_save(sd, checkpoint_id=str(tmp_path / f"step-{step}"), process_group=side,
                           async_stager=stager).result()
            ptrs.append(stager._buffers["/model/0.weight"].data_ptr())
    assert not [w for w in caught if "DcpStager" in str(w.message)]
    assert ptrs[0] == ptrs[1]


@pytest.mark.parametrize("scale", ["scale_gradients", "finalize_model_grads"])
def test_zero1_steps_on_gradients_meshddp_scaled_after_finish_grad_sync(mesh, scale):
    # Before: step() refused, blaming torch's clip_grad_norm_, gradients that meshddp itself had scaled
    # after finish_grad_sync() (docs/guide/pipelines.md allows it: after finish_grad_sync, before the step).
    m = model()
    golden = model()
    ddp = meshddp.DistributedDataParallel(m, mesh, config=meshddp.DdpConfig(use_distributed_optimizer=True))
    opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="sgd", lr=0.1))
    x = torch.randn(3, 4)
    ddp.zero_grad_buffer()
    ddp(x).sum().backward()
    ddp.finish_grad_sync()
    if scale == "scale_gradients":
        ddp.scale_gradients(0.25)
    else:
        assert meshddp.finalize_model_grads([ddp], num_tokens=4) == 4
    golden(x).sum().backward()
    opt.step()
    opt.finish_param_sync()
    for p, g in zip(m.parameters(), golden.parameters()):
        torch.testing.assert_close(p.detach(), g.detach() - 0.1 * 0.25 * g.grad, rtol=0, atol=1e-7)
    # A foreign in-place write after meshddp's scaling is still refused.
    ddp.zero_grad_buffer()
    ddp(x).sum().backward()
    ddp.finish_grad_sync()
    ddp.scale_gradients(0.5)
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match=r"the gradients were changed in place after finish_grad_sync\(\)"):
        opt.step()


def test_a_torch_optimizer_over_a_zero1_wrapper_is_refused_naming_the_param(mesh):
    # Before: torch's SGD stepped each rank on its own partly unreduced gradient (ZeRO-1 reduces each
    # rank's shard only): at 2 ranks with comm_hook="bf16_compress" the ranks' params differed by 0.3
    # after 2 steps, no error. One rank here: the refusal itself.
    m = model()
    ddp = meshddp.DistributedDataParallel(m, mesh, config=meshddp.DdpConfig(use_distributed_optimizer=True))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ddp.zero_grad_buffer()
    ddp(torch.randn(3, 4)).sum().backward()
    ddp.finish_grad_sync()
    before = snapshot(m)
    with pytest.raises(RuntimeError, match=r"SGD.step\(\) on parameter '0.weight', whose gradient is sharded for "
                                           r"the distributed optimizer \(DdpConfig data_parallel_sharding_strategy='optim'\)"
                                           r".*meshddp.DistributedOptimizer"):
        opt.step()
    assert unchanged(m, before)


def test_lr_scheduler_attached_twice_to_one_optimizer_says_so():
    # Before: "the optimizer's default lr is 0.0; give it the schedule's max_lr" (the first attach had set
    # the warm-up's LR 0 as the default), pointing at the optimizer's construction.
    opt = torch.optim.SGD(model().parameters(), lr=1e-2)
    sched = meshddp.LrScheduler(meshddp.LrScheduleConfig(max_lr=1e-2, warmup_steps=2, decay_steps=6))
    sched.attach(opt)
    with pytest.raises(ValueError, match=r"this SGD is already attached to this scheduler"):
        sched.attach(opt)


def test_grad_scaler_over_zero1_skips_an_inf_on_every_rank_together():
    # Before: GradScaler checked each rank's .grad (under ZeRO-1 only its own shard is reduced): rank 1
    # found the inf and skipped the step, rank 0 did not and waited in the step's collective: a hang.
    import multiprocess

    results = multiprocess.run(2, "porting_workers.grad_scaler_with_zero1")
    for scales, params, golden in results:
        assert scales == [2.0, 2.0]  # halved once, on both ranks
        for p, g in zip(params[1], golden):
            torch.testing.assert_close(p, g, rtol=0, atol=1e-3)  # bf16-compressed gradients (measured 3.7e-4)
    for a, b in zip(results[0][1][0], results[1][1][0]):
        assert torch.equal(a, b)  # step 0 skipped alike
    first = model()
    for p, p0 in zip(results[0][1][0], first.parameters()):
        assert torch.equal(p, p0.detach())  # skipped: unchanged
