"""Gradients off the plain path, from Python, on one rank in this process: torch.autograd.grad and
torch.autocast through meshddp.linear_with_grad_in_buffer (golden: F.linear on a copy of the params),
weights loaded under ZeRO-1 with bf16 params, params frozen or unfrozen after wrapping, and params
that cannot live in a flat buffer (meta).

What the cases check:
- one rank: torch.autograd.grad through linear_with_grad_in_buffer returns the true gradient and the next
  backward gives 1.000x (was 2x); under torch.autocast("cpu", bfloat16) it matches F.linear (output identical,
  gradients within 2^-7 of the sum of each micro-batch's gradient magnitude: one bf16 rounding per micro-batch
  on each side); load_state_dict under ZeRO-1 with bf16 params survives a zero-gradient SGD step, and
  reload_masters_from_params(); a param (also a DTensor param) frozen or unfrozen after wrapping is refused
  naming it (the weight not moved by AdamW); a meta-device model is refused naming the param; a gradient
  penalty (create_graph) under autocast reaches the weight as through F.linear; a resume by load_state_dict +
  load_checkpoint in either order and a partial load_state_dict keep the fp32 masters (bit-exact);
  state_dict() right after step() waits for the param all-gathers; an nn.Embedding(sparse=True) and an
  uninitialized lazy module are refused at wrap naming them
"""


import pytest
import torch
import torch.nn.functional as F

import meshddp


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
            ddp.set_requires_gradient_sync(micro == 1)
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


def test_a_gradient_penalty_under_cpu_autocast_reaches_the_weight_as_through_F_linear():
    # create_graph through the bare function (the golden's own path); the weight used to get no
    # second-order gradient. Same bf16 ops on the same casts on both sides: rtol 2^-7.
    model = InBufferLinear()
    ref = torch.nn.Linear(8, 6)
    ref.load_state_dict(model.fc.state_dict())
    x0 = torch.randn(5, 8, generator=torch.Generator().manual_seed(2))
    grads = []
    for fn, w, b in ((meshddp.linear_with_grad_in_buffer, model.fc.weight, model.fc.bias), (F.linear, ref.weight, ref.bias)):
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(x, w, b)
        (gx,) = torch.autograd.grad(loss_of(out), [x], create_graph=True)
        loss_of(gx).backward()
        assert w.grad is not None, "the gradient penalty did not reach the weight"
        grads.append((w.grad, x.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=2**-7, atol=1e-5)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=2**-7, atol=1e-5)


def test_load_state_dict_under_zero1_with_bf16_params_refreshes_the_masters(mesh):
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    config = meshddp.DdpConfig(use_distributed_optimizer=True, bucket_bytes=0)
    ddp = meshddp.DistributedDataParallel(model, mesh, config=config)
    opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="sgd", lr=0.1, momentum=0.0, weight_decay=0.0))
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


def _zero1_bf16(mesh, lr, overlap=False, model=None):
    torch.manual_seed(0)
    model = (model or torch.nn.Linear(4, 4)).to(torch.bfloat16)
    config = meshddp.DdpConfig(use_distributed_optimizer=True, bucket_bytes=0)
    ddp = meshddp.DistributedDataParallel(model, mesh, config=config)
    opt_config = meshddp.DistributedOptimizerConfig(kind="sgd", lr=lr, momentum=0.0, weight_decay=0.0, overlap_param_gather=overlap)
    return model, ddp, meshddp.DistributedOptimizer(ddp, opt_config)


def _sgd_steps(ddp, opt, n, width=4):
    for _ in range(n):
        ddp.zero_grad_buffer()
        ddp(torch.ones(2, width, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
        opt.finish_param_sync()


def test_a_resume_by_load_state_dict_and_load_checkpoint_in_either_order_is_bit_exact(mesh, tmp_path):
    # lr 1e-4: each update is below bf16's resolution of the weights, so only the fp32 masters hold
    # the progress; a resume that rebuilt them from the bf16 params lost it (the weights stayed put).
    model, ddp, opt = _zero1_bf16(mesh, lr=1e-4)
    _sgd_steps(ddp, opt, 10)
    opt.save_checkpoint(str(tmp_path))
    state = {k: v.clone() for k, v in ddp.state_dict().items()}
    _sgd_steps(ddp, opt, 10)
    for order in ("state_dict_then_checkpoint", "checkpoint_then_state_dict"):
        resumed, ddp2, opt2 = _zero1_bf16(mesh, lr=1e-4)
        if order == "state_dict_then_checkpoint":
            ddp2.load_state_dict(state)
            opt2.load_checkpoint(str(tmp_path))
        else:
            opt2.load_checkpoint(str(tmp_path))
            ddp2.load_state_dict(state)
        _sgd_steps(ddp2, opt2, 10)
        for name, p in model.named_parameters():
            assert torch.equal(dict(resumed.named_parameters())[name], p), f"{order}: {name} differs from the uninterrupted run"


def test_a_partial_load_state_dict_keeps_the_fp32_masters_of_the_params_it_does_not_load(mesh):
    runs = []
    for partial_load in (False, True):
        model, ddp, opt = _zero1_bf16(mesh, lr=1e-4)
        _sgd_steps(ddp, opt, 15)
        if partial_load:  # the bias only, with the value it has: the weight's master must survive
            ddp.load_state_dict({"bias": model.bias.detach().clone()}, strict=False)
        _sgd_steps(ddp, opt, 15)
        runs.append(model.weight.detach().clone())
    assert torch.equal(runs[0], runs[1]), f"max difference {(runs[0].float() - runs[1].float()).abs().max().item()}"


def test_state_dict_right_after_a_step_waits_for_the_param_all_gathers():
    # 2 ranks (on one the gather has nothing to wait for): it read half the params stale.
    import multiprocess

    stale = multiprocess.run(2, "state_dict_right_after_step")
    assert stale == [0, 0], f"state_dict() right after step() read {stale} stale elements (by rank)"


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


def test_an_embedding_with_sparse_gradients_is_refused_at_wrap_naming_the_module(mesh):
    # It used to be taken, then step 1's backward failed in torch's "copy_() between dense and sparse".
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    with pytest.raises(RuntimeError, match=r"module '0' is a Embedding with sparse=True, .* build it with sparse=False"):
        meshddp.DistributedDataParallel(model, mesh)


def test_an_uninitialized_lazy_module_is_refused_at_wrap_naming_the_param(mesh):
    # It used to be taken, then backward failed with torch's internal error.
    model = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.Tanh())
    with pytest.raises(RuntimeError, match=r"parameter '0.weight' is uninitialized .* run one forward"):
        meshddp.DistributedDataParallel(model, mesh)
    model(torch.ones(2, 3))  # materialized: taken
    meshddp.DistributedDataParallel(model, mesh)
