"""The state dict of torch.compile(ddp) (an OptimizedModule around meshddp's wrapper) round-trips:
state_dict() gives the module's keys under "_orig_mod." (the wrapper's own keys carry no "module."),
and load_state_dict() of those keys, which nn.Module's recursion hands to the wrapper as a submodule
(not through its load_state_dict), loads them, refuses assign=True, and with the distributed optimizer
refreshes its fp32 master weights of bf16 params (else the next step would write the old weights back). One process."""

import pytest
import torch

import meshddp


def build(mesh, zero1):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    if zero1:
        model.to(torch.bfloat16)  # fp32 master weights apart from the params: the refresh is observable
    ddp = meshddp.DistributedDataParallel(model, mesh, config=meshddp.DdpConfig(use_distributed_optimizer=zero1))
    return model, ddp, torch.compile(ddp, backend="eager")


@pytest.mark.parametrize("zero1", [False, True])
def test_compiled_wrapper_state_dict_round_trips(mesh, zero1):
    model, ddp, compiled = build(mesh, zero1)
    config = meshddp.DistributedOptimizerConfig(lr=0.1, weight_decay=0.0)
    opt = meshddp.DistributedOptimizer(ddp, config) if zero1 else None
    saved = compiled.state_dict()
    assert sorted(saved) == sorted("_orig_mod." + k for k in model.state_dict())
    loaded = {k: torch.full_like(v, 0.5) for k, v in saved.items()}
    compiled.load_state_dict(loaded)
    for name, value in model.state_dict().items():
        assert torch.equal(value, loaded["_orig_mod." + name]), name
    if zero1:  # a step on zero gradients keeps the loaded params (AdamW: 0 / (0 + eps) = 0)
        ddp.zero_grad_buffer()
        ddp.finish_grad_sync()
        opt.step()
        opt.finish_param_sync()
        for name, value in model.state_dict().items():
            assert torch.equal(value, loaded["_orig_mod." + name]), name


def test_compiled_wrapper_load_state_dict_with_assign_is_refused(mesh):
    model, ddp, compiled = build(mesh, False)
    with pytest.raises(RuntimeError, match=r"assign=True"):
        compiled.load_state_dict(compiled.state_dict(), assign=True)
