"""Gradients off the plain path, from Python, on one rank in this process: torch.autograd.grad and
torch.autocast through meshddp.linear_with_grad_in_buffer (golden: F.linear on a copy of the params),
weights loaded under ZeRO-1 with bf16 params, params frozen or unfrozen after wrapping, and params
that cannot live in a flat buffer (meta)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import meshddp


@pytest.fixture(scope="module")
def mesh():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    import multiprocess

    os.environ["MASTER_PORT"] = str(multiprocess._free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    dist.destroy_process_group()


class InBufferLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.fc = torch.nn.Linear(8, 6)

    def forward(self, x):
        return meshddp.linear_with_grad_in_buffer(x, self.fc.weight, self.fc.bias)


def loss_of(out):
    return out.float().pow(2).sum()


def test_autograd_grad_returns_the_true_gradient_and_the_next_backward_counts_it_once(mesh):
    model = InBufferLinear()
    ref = torch.nn.Linear(8, 6)
    ref.load_state_dict(model.fc.state_dict())
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    golden = torch.autograd.grad(loss_of(ref(x)), [ref.weight, ref.bias])

    ddp = meshddp.DistributedDataParallel(model, mesh)
    ddp.zero_grad_buffer()
    got = torch.autograd.grad(loss_of(ddp(x)), [model.fc.weight, model.fc.bias])
    torch.testing.assert_close(got[0], golden[0], rtol=0, atol=0)  # was zeros (the placeholder)
    torch.testing.assert_close(got[1], golden[1], rtol=0, atol=0)
    assert torch.count_nonzero(ddp.main_grad("fc.weight")) == 0  # the buffer was left alone

    loss_of(ddp(x)).backward()
    ddp.finish_grad_sync()
    ratio = (ddp.main_grad("fc.weight").sum() / golden[0].sum()).item()
    assert ratio == 1.0, f"the real backward after autograd.grad gave {ratio:.3f}x the gradient"
    torch.testing.assert_close(model.fc.weight.grad, golden[0], rtol=0, atol=0)


def test_under_cpu_autocast_it_behaves_as_F_linear(mesh):
    """Output bf16 and identical (the same bf16 GEMM). Gradients fp32, within bf16's rounding of each
    micro-batch's gradient: |ours - golden| <= 2**-7 * sum over micro-batches of |its gradient| (each
    side rounds a micro-batch's gradient to bf16 at most once, unit roundoff 2**-8: the weight
    gradient's GEMM runs in another order in F.linear, the bias is summed in fp32 here and in bf16 by
    F.linear). Two steps of two micro-batches: stale slots overwritten, then accumulated."""
    model = InBufferLinear()
    ref = torch.nn.Linear(8, 6)
    ref.load_state_dict(model.fc.state_dict())
    ddp = meshddp.DistributedDataParallel(model, mesh)
    gen = torch.Generator().manual_seed(2)
    for step in range(2):
        ddp.zero_grad_buffer()
        ref.zero_grad()
        bound = {name: torch.zeros_like(p) for name, p in ref.named_parameters()}
        for micro in range(2):
            ddp.set_is_last_microbatch(micro == 1)
            x = torch.randn(5, 8, generator=gen)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out, expected = ddp(x), ref(x)
            assert out.dtype == torch.bfloat16
            torch.testing.assert_close(out, expected, rtol=0, atol=0)
            loss_of(out).backward()  # threw "expected m1 and m2 to have the same dtype"
            before = {name: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                      for name, p in ref.named_parameters()}
            loss_of(expected).backward()
            for name, p in ref.named_parameters():
                bound[name] += (p.grad - before[name]).abs() / 128
        ddp.finish_grad_sync()
        for name, p in ref.named_parameters():
            got = ddp.main_grad(f"fc.{name}")
            assert got.dtype == torch.float32
            excess = (got - p.grad).abs() - bound[name] - 1e-6
            assert excess.max() <= 0, f"step {step}: fc.{name} off by more than the bound:\n{got}\nvs\n{p.grad}"


def test_load_state_dict_under_zero1_with_bf16_params_refreshes_the_masters(mesh):
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    config = meshddp.DdpConfig(use_distributed_optimizer=True, bucket_bytes=0)
    ddp = meshddp.DistributedDataParallel(model, mesh, config=config)
    opt = meshddp.DistributedOptimizer(ddp, meshddp.OptimizerConfig(kind="sgd", lr=0.1, momentum=0.0, weight_decay=0.0))
    ddp.zero_grad_buffer()
    loss_of(ddp(torch.randn(3, 4).to(torch.bfloat16))).backward()
    opt.step()  # the masters now hold this step's weights

    state = {k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()}
    ddp.load_state_dict(state)
    ddp.zero_grad_buffer()
    opt.step()  # a zero gradient: SGD must keep what was loaded (it wrote the stale masters back)
    opt.finish_param_sync()
    for name, p in model.named_parameters():
        assert torch.all(p == 0.5), f"{name} after a zero-gradient step: {p.flatten()[:4]}"

    with pytest.raises(RuntimeError, match=r"load_state_dict\(assign=True\) would replace the parameters"):
        ddp.load_state_dict(state, assign=True)

    # Params written another way: reload_masters_from_params() by hand.
    with torch.no_grad():
        model.weight.fill_(0.25)
    opt.reload_masters_from_params()
    ddp.zero_grad_buffer()
    opt.step()
    opt.finish_param_sync()
    assert torch.all(model.weight == 0.25)


def test_a_param_frozen_or_unfrozen_after_wrapping_is_refused_naming_it(mesh):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)
    ddp = meshddp.DistributedDataParallel(model, mesh)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.01, weight_decay=0.1)
    x = torch.randn(3, 4)

    ddp.zero_grad_buffer()
    model[2].weight.requires_grad_(False)
    before = model[2].weight.detach().clone()
    ddp(x).sum().backward()
    with pytest.raises(RuntimeError, match=r"finish_grad_sync\(\): parameter '2.weight' was trainable when the model "
                                           r"was wrapped but now has requires_grad=False"):
        ddp.finish_grad_sync()
        opt.step()
    assert torch.equal(model[2].weight, before)  # AdamW's weight decay moved it before

    model[2].weight.requires_grad_(True)
    model[0].bias.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"zero_grad_buffer\(\): parameter '0.bias' was frozen \(requires_grad="
                                           r"False\) when the model was wrapped but now requires grad"):
        ddp.zero_grad_buffer()


def test_a_dtensor_param_frozen_after_wrapping_is_refused_naming_it(mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(output_layouts=None)})
    ddp = meshddp.DistributedDataParallel(model, mesh)
    ddp.zero_grad_buffer()
    model[0].weight.requires_grad_(False)
    F.mse_loss(ddp(torch.randn(3, 4)), torch.zeros(3, 2)).backward()
    with pytest.raises(RuntimeError, match=r"finish_grad_sync\(\): DTensor parameter '0.weight' was trainable when "
                                           r"the model was wrapped but now has requires_grad=False"):
        ddp.finish_grad_sync()


def test_a_model_on_the_meta_device_is_refused_naming_the_param(mesh):
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match=r"parameter 'weight' is on the meta device .* materialize it first"):
        meshddp.DistributedDataParallel(model, mesh)
