"""optimizer.zero_grad() with meshddp (docs/reference/python_api.md, "Limits"): in addition to
ddp.zero_grad_buffer() it is harmless (the params train exactly as with zero_grad_buffer() alone, and
as torch in one process); instead of it, the next step fails naming zero_grad_buffer(). One rank, in
this process."""

import pytest
import torch
import torch.nn.functional as F

import meshddp

STEPS = 3


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def train(mesh, zero):
    """Params after STEPS AdamW steps; zero(ddp, opt) runs at the start of each step."""
    m = model()
    ddp = meshddp.DistributedDataParallel(m, mesh, config=meshddp.DdpConfig(bucket_bytes=0))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    for step in range(STEPS):
        zero(ddp, opt)
        x, y = batch(step)
        F.mse_loss(ddp(x), y).backward()
        ddp.finish_grad_sync()
        opt.step()
    return [p.detach().clone() for p in m.parameters()]


def golden():
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step)
        F.mse_loss(m(x), y).backward()
        opt.step()
    return [p.detach() for p in m.parameters()]


def both(ddp, opt):
    ddp.zero_grad_buffer()
    opt.zero_grad()  # set_to_none after zero_grad_buffer(): the next hook moves each grad into its slot


def test_optimizer_zero_grad_in_addition_to_zero_grad_buffer_trains_as_torch(mesh):
    alone = train(mesh, lambda ddp, opt: ddp.zero_grad_buffer())
    with_opt = train(mesh, both)
    for a, b, g in zip(alone, with_opt, golden()):
        assert torch.equal(a, b)
        torch.testing.assert_close(b, g, rtol=1e-6, atol=1e-7)  # one rank: the same sums as torch's


def test_optimizer_zero_grad_instead_of_zero_grad_buffer_fails_the_next_step_naming_zero_grad_buffer(mesh):
    calls = []

    def zero(ddp, opt):  # the first step as documented, then opt.zero_grad() alone
        (opt.zero_grad if calls else ddp.zero_grad_buffer)()
        calls.append(1)

    with pytest.raises(RuntimeError, match=r"zero_grad_buffer\(\)"):
        train(mesh, zero)
    assert len(calls) == 2  # it is the second step that fails
