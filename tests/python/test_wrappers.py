"""meshddp's wrapper next to the torch code around it: wrapped twice (meshddp in meshddp, two wrappers
over one model, torch's DDP around meshddp's or inside it), a torch optimizer stepping before
finish_grad_sync(), and a forward through the raw module while ZeRO-1's param all-gathers are in
flight (meshddp/_guards.py). Each is right, or an error naming the way out.

What the cases check:
- meshddp around meshddp and two live wrappers over one model refused naming the param, then fine once the
  first is deleted; meshddp around torch's DDP refused; torch's DDP around meshddp's leaves its params alone
  (around it alone: torch's "not needed" error; deeper: refused at forward, then fine with
  _set_params_and_buffers_to_ignore_for_model); a torch SGD.step() before finish_grad_sync() refused with
  params unchanged; on 2 ranks, ZeRO-1 with overlap_param_gather, the raw module's forward right after step()
  (same thread, and another thread) equals the one after finish_param_sync() exactly
"""

import gc

import multiprocess
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import meshddp


def model():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def test_meshddp_around_meshddp_is_refused_naming_the_param(mesh):
    inner = meshddp.DistributedDataParallel(model(), mesh)
    with pytest.raises(RuntimeError, match=r"parameter '0.weight' already belongs to a live meshddp "
                                           r"DistributedDataParallel \(which knows it as '0.weight'\).*2x gradients.*"
                                           r"Wrap the model once"):
        meshddp.DistributedDataParallel(inner, mesh)
    del inner


def test_two_live_wrappers_over_one_model_are_refused_until_the_first_is_gone(mesh):
    m = model()
    first = meshddp.DistributedDataParallel(m, mesh)
    with pytest.raises(RuntimeError, match=r"parameter '0.weight' already belongs to a live meshddp"):
        meshddp.DistributedDataParallel(m, mesh)
    with pytest.raises(RuntimeError, match=r"parameter 'weight' already belongs .*knows it as '2.weight'"):
        meshddp.DistributedDataParallel(m[2], mesh)  # a part of the wrapped model
    del first
    gc.collect()
    second = meshddp.DistributedDataParallel(m, mesh)  # the way out: the first wrapper is gone
    second.zero_grad_buffer()
    second(torch.randn(3, 4)).sum().backward()
    second.finish_grad_sync()


def test_meshddp_around_torch_ddp_is_refused(mesh):
    torch_ddp = TorchDDP(model())
    with pytest.raises(RuntimeError, match=r"the module is a torch.nn.parallel.DistributedDataParallel.*"
                                           r"give meshddp the model itself \(torch_ddp.module\)"):
        meshddp.DistributedDataParallel(torch_ddp, mesh)


def test_torch_ddp_around_meshddp_leaves_meshddp_params_alone(mesh):
    # Around meshddp's wrapper alone: torch's DDP is told to ignore every meshddp param, so it has
    # nothing left to reduce and says so (no gradient is averaged twice).
    ddp = meshddp.DistributedDataParallel(model(), mesh)
    assert "module.0.weight" in ddp._ddp_params_and_buffers_to_ignore
    with pytest.raises(RuntimeError, match=r"DistributedDataParallel is not needed when a module doesn't have any "
                                           r"parameter that requires a gradient"):
        TorchDDP(ddp)
    del ddp
    gc.collect()
    # meshddp's wrapper deeper inside the module torch wraps: refused at the first forward, naming it...
    inner = meshddp.DistributedDataParallel(model(), mesh)
    outer_model = torch.nn.Sequential(inner, torch.nn.Linear(2, 2))
    outer = TorchDDP(outer_model)
    with pytest.raises(RuntimeError, match=r"parameter '0.weight' is reduced by this meshddp DistributedDataParallel "
                                           r"and also by the torch DistributedDataParallel around it"):
        outer(torch.randn(3, 4))
    del outer
    # ... and fine once torch's DDP is told to leave meshddp's params alone: it reduces only its own.
    TorchDDP._set_params_and_buffers_to_ignore_for_model(
        outer_model, [f"0.{n}" for n in meshddp._guards.names_for_torch_ddp(inner.module)])
    outer = TorchDDP(outer_model)
    inner.zero_grad_buffer()
    outer(torch.randn(3, 4)).sum().backward()
    inner.finish_grad_sync()
    assert outer_model[1].weight.grad is not None


def test_torch_ddp_over_a_model_meshddp_wraps_finds_nothing_to_reduce(mesh):
    m = model()
    ddp = meshddp.DistributedDataParallel(m, mesh)
    with pytest.raises(RuntimeError, match=r"DistributedDataParallel is not needed when a module doesn't have any "
                                           r"parameter that requires a gradient"):
        TorchDDP(m)
    del ddp
    gc.collect()
    assert not hasattr(m, "_ddp_params_and_buffers_to_ignore"), "the mark outlived the wrapper"
    TorchDDP(m)  # the model is torch's to wrap once meshddp's wrapper is gone


def test_a_torch_optimizer_step_before_finish_grad_sync_is_refused_naming_the_call(mesh):
    ddp = meshddp.DistributedDataParallel(model(), mesh)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    before = [p.detach().clone() for p in ddp.parameters()]
    ddp.zero_grad_buffer()
    ddp(torch.randn(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"SGD.step\(\) was called while this step's gradient sync is still "
                                           r"running.*Call ddp.finish_grad_sync\(\) after the last backward and "
                                           r"before optimizer.step\(\)"):
        opt.step()
    assert all(torch.equal(b, p) for b, p in zip(before, ddp.parameters())), "the refused step changed params"
    ddp.finish_grad_sync()
    opt.step()  # fine once synced
    other = torch.optim.SGD(model().parameters(), lr=0.1)  # an optimizer over other params is not concerned
    ddp.zero_grad_buffer()
    ddp(torch.randn(3, 4)).sum().backward()
    other.step()
    ddp.finish_grad_sync()


@pytest.mark.parametrize("on_thread", [False, True], ids=["same_thread", "other_thread"])
def test_a_raw_module_forward_after_an_overlapped_zero1_step_sees_this_steps_params(on_thread):
    results = multiprocess.run(2, "wrapper_workers.raw_forward_after_overlapped_step", on_thread=on_thread)
    for rank, steps in enumerate(results):
        for step, (pending, diff) in enumerate(steps):
            assert diff == 0.0, f"rank {rank} step {step}: the raw module's forward read stale params " \
                                f"(max |diff| {diff}, {pending} gathers pending after step())"
    assert any(pending > 0 for steps in results for pending, _ in steps), "no gather was in flight: nothing tested"
