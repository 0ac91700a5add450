// linear_with_grad_in_buffer off the plain backward path: torch::autograd::grad (the gradient comes
// back to the caller, the buffer is left alone, so the next real backward counts it once) and
// autocast (CPU bf16: the same casts, output dtype and gradients as torch::nn::functional::linear;
// also through tp::Linear on a TP mesh) and double backward (a gradient penalty, with autocast and
// through tp::Linear).
// Golden: the same layer as torch::linear on a copy of the params, in one process.
#include "tp/linear_with_grad_in_buffer.h"

#include "grad_buffer/grad_buffer.h"
#include "plugin/distributed_data_parallel.h"
#include "tests/support/rank_threads.h"
#include "tp/parallelize.h"
#include "tp/tp_layers.h"

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

using namespace meshddp;
using namespace meshddp::test;

namespace {

constexpr int64_t kIn = 8, kOut = 6, kRows = 5;

struct InBufferLinearImpl : torch::nn::Module {
  InBufferLinearImpl() {
    torch::manual_seed(3);
    fc = register_module("fc", torch::nn::Linear(kIn, kOut));
  }
  torch::Tensor forward(const torch::Tensor& x) { return linear_with_grad_in_buffer(x, fc->weight, fc->bias); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(InBufferLinear);

torch::Tensor input(int64_t step) {
  torch::manual_seed(50 + step);
  return torch::randn({kRows, kIn});
}

// A loss whose gradient differs per element (not a plain sum).
torch::Tensor loss_of(const torch::Tensor& out) { return out.to(torch::kFloat).pow(2).sum(); }

// CPU autocast to bf16 for a scope (torch.autocast("cpu", torch.bfloat16) in C++).
struct CpuAutocast {
  CpuAutocast() {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
  }
  ~CpuAutocast() {
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
  }
};

}  // namespace

// autograd::grad(loss, {w, b}) returns the true gradient (the old path handed back the zero
// placeholder and left the gradient in the slot), the slot stays as it was (zeros: the first step),
// and the real backward that follows gives exactly 1x the gradient in the slot (was 2x). Exact:
// the same GEMM as the golden's on the same operands.
TEST(LinearWithGradInBuffer, AutogradGradReturnsTheGradientAndLeavesTheBufferAlone) {
  run_on_mesh({1}, {"dp"}, [](DeviceMesh& mesh) {
    InBufferLinear model;
    const torch::Tensor w0 = model->fc->weight.detach().clone().requires_grad_(true);
    const torch::Tensor b0 = model->fc->bias.detach().clone().requires_grad_(true);
    const torch::Tensor x = input(0);
    const auto golden = torch::autograd::grad({loss_of(torch::linear(x, w0, b0))}, {w0, b0});

    DistributedDataParallel ddp(model.ptr(), mesh, "dp");
    ddp.zero_grad_buffer();
    const auto got = torch::autograd::grad({loss_of(ddp.forward(x))}, {model->fc->weight, model->fc->bias});
    EXPECT_TRUE(torch::equal(got[0], golden[0])) << "autograd::grad's weight gradient:\n" << got[0];
    EXPECT_TRUE(torch::equal(got[1], golden[1])) << "autograd::grad's bias gradient:\n" << got[1];
    EXPECT_EQ(ddp.grad_buffer()->stats().grads_written_in_place, 0);
    EXPECT_TRUE(torch::equal(ddp.main_grad("fc.weight"), torch::zeros_like(w0))) << "the slot was written";

    loss_of(ddp.forward(x)).backward();
    ddp.finish_grad_sync();
    EXPECT_EQ(ddp.grad_buffer()->stats().grads_written_in_place, 2);  // the real backward still writes in place
    const double ratio = (ddp.main_grad("fc.weight").sum() / golden[0].sum()).item<double>();
    EXPECT_DOUBLE_EQ(ratio, 1.0);
    EXPECT_TRUE(torch::equal(ddp.main_grad("fc.weight"), golden[0]));
    EXPECT_TRUE(torch::equal(ddp.main_grad("fc.bias"), golden[1]));
  });
}

// Under CPU autocast (bf16) the in-buffer linear matches torch::nn::functional::linear: the output
// is bf16 and bit-identical (the same bf16 GEMM on the same casts), and after two steps of two
// micro-batches each (stale slots overwritten, then accumulated) the fp32 main grads agree with the
// golden's fp32 .grad to within bf16's rounding of each micro-batch's gradient: per element,
// |ours - golden| <= 2^-7 * sum over micro-batches of |that micro-batch's gradient| (each side
// rounds a micro-batch's gradient to bf16 at most once, unit roundoff 2^-8: the weight gradient is
// a bf16 GEMM on both sides, F.linear's in another order; the bias gradient is summed in fp32 here,
// in bf16 by F.linear). The bound is on the terms, not the result: two micro-batches' gradients of
// opposite sign cancel, their rounding does not. Used to throw "expected m1 and m2 to have the same
// dtype".
TEST(LinearWithGradInBuffer, UnderCpuAutocastBehavesAsFunctionalLinear) {
  run_on_mesh({1}, {"dp"}, [](DeviceMesh& mesh) {
    InBufferLinear model;
    auto golden = torch::nn::Linear(kIn, kOut);
    {
      torch::NoGradGuard no_grad;
      golden->weight.copy_(model->fc->weight);
      golden->bias.copy_(model->fc->bias);
    }
    const auto grad_or_zeros = [](const torch::Tensor& p) {
      return p.grad().defined() ? p.grad().detach().clone() : torch::zeros_like(p);
    };
    DistributedDataParallel ddp(model.ptr(), mesh, "dp");
    for (int64_t step = 0; step < 2; ++step) {
      ddp.zero_grad_buffer();
      golden->zero_grad();
      torch::Tensor bound_w = torch::zeros_like(golden->weight), bound_b = torch::zeros_like(golden->bias);
      for (int64_t micro = 0; micro < 2; ++micro) {
        ddp.set_is_last_microbatch(micro == 1);
        const torch::Tensor x = input(10 * step + micro).requires_grad_(true);
        const torch::Tensor x_ref = x.detach().clone().requires_grad_(true);
        torch::Tensor out, ref;
        {
          CpuAutocast autocast;
          out = ddp.forward(x);
          ref = torch::nn::functional::linear(x_ref, golden->weight, golden->bias);
        }
        ASSERT_EQ(out.scalar_type(), torch::kBFloat16);
        EXPECT_TRUE(torch::equal(out, ref)) << "step " << step << " micro-batch " << micro;
        loss_of(out).backward();
        const torch::Tensor w_before = grad_or_zeros(golden->weight), b_before = grad_or_zeros(golden->bias);
        loss_of(ref).backward();
        bound_w += (golden->weight.grad() - w_before).abs() / 128;
        bound_b += (golden->bias.grad() - b_before).abs() / 128;
        ASSERT_EQ(x.grad().scalar_type(), torch::kFloat);
        // One bf16 GEMM per side, no accumulation: rtol 2^-7.
        EXPECT_TRUE(torch::allclose(x.grad(), x_ref.grad(), 1.0 / 128, 1e-6)) << "input gradient";
      }
      ddp.finish_grad_sync();
      const torch::Tensor gw = ddp.main_grad("fc.weight"), gb = ddp.main_grad("fc.bias");
      ASSERT_EQ(gw.scalar_type(), torch::kFloat);
      EXPECT_TRUE((gw - golden->weight.grad()).abs().le(bound_w + 1e-6).all().item<bool>()) << "step " << step << ":\n"
                                                                                            << gw << "\nvs\n"
                                                                                            << golden->weight.grad();
      EXPECT_TRUE((gb - golden->bias.grad()).abs().le(bound_b + 1e-6).all().item<bool>()) << "step " << step << ":\n"
                                                                                          << gb << "\nvs\n"
                                                                                          << golden->bias.grad();
    }
    EXPECT_EQ(ddp.grad_buffer()->stats().grads_written_in_place, 2);  // both written in place, not through autograd
  });
}

// Without a buffer (no DDP: the golden's own path) the function under autocast returns F.linear's
// gradients, in the params' dtype (same tolerance as above: bf16 GEMMs of the same operands).
TEST(LinearWithGradInBuffer, WithoutABufferUnderCpuAutocastReturnsGradientsInTheParamsDtype) {
  InBufferLinear model;
  const torch::Tensor w0 = model->fc->weight.detach().clone().requires_grad_(true);
  const torch::Tensor b0 = model->fc->bias.detach().clone().requires_grad_(true);
  const torch::Tensor x = input(0);
  torch::Tensor out, ref;
  {
    CpuAutocast autocast;
    out = model->forward(x);
    ref = torch::nn::functional::linear(x, w0, b0);
  }
  loss_of(out).backward();
  loss_of(ref).backward();
  ASSERT_EQ(model->fc->weight.grad().scalar_type(), torch::kFloat);
  EXPECT_TRUE(torch::allclose(model->fc->weight.grad(), w0.grad(), 1.0 / 128, 1e-3));
  EXPECT_TRUE(torch::allclose(model->fc->bias.grad(), b0.grad(), 1.0 / 128, 1e-3));
}

namespace {

// fc1 column-parallel, fc2 row-parallel under a plan: every meshddp::tp::Linear runs the in-buffer linear.
struct TpMlpImpl : torch::nn::Module {
  TpMlpImpl() {
    torch::manual_seed(4);
    fc1 = register_module("fc1", tp::Linear(kIn, 4));
    fc2 = register_module("fc2", tp::Linear(4, kOut));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(fc1(x))); }
  tp::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(TpMlp);

// A TpMlp holding `golden`'s values, parallelized over the mesh's "tp" dim.
TpMlp tp_copy_of(const TpMlp& golden, const DeviceMesh& mesh) {
  TpMlp model;
  {
    torch::NoGradGuard no_grad;  // the golden's weights (rank threads share torch's RNG)
    for (const auto& item : golden->named_parameters()) model->named_parameters()[item.key()].copy_(item.value());
  }
  parallelize(*model, mesh, {{"fc1", ColwiseParallel{}}, {"fc2", RowwiseParallel{}}});
  return model;
}

// Each param's synced gradient on this TP rank (main_grad, fp32) is its shard of `golden`'s gradient
// (fc1 split by rows, fc2 by columns, fc2's bias whole), within rtol / atol.
void expect_main_grads_are_golden_shards(const DdpEngine& ddp, const TpMlp& golden, const DeviceMesh& mesh, double rtol,
                                         double atol) {
  const int64_t r = mesh.coordinate("tp");
  const auto shard = [&](const torch::Tensor& t, int64_t dim) { return t.chunk(2, dim)[r]; };
  const std::vector<std::pair<std::string, torch::Tensor>> expected = {
      {"fc1.weight", shard(golden->fc1->weight.grad(), 0)},
      {"fc1.bias", shard(golden->fc1->bias.grad(), 0)},
      {"fc2.weight", shard(golden->fc2->weight.grad(), 1)},
      {"fc2.bias", golden->fc2->bias.grad()}};
  for (const auto& [name, want] : expected) {
    const torch::Tensor got = ddp.main_grad(name);
    ASSERT_EQ(got.scalar_type(), torch::kFloat) << name;
    EXPECT_TRUE(torch::allclose(got, want, rtol, atol)) << name << " on TP rank " << r << ":\n"
                                                        << got << "\nvs\n"
                                                        << want;
  }
}

}  // namespace

// tp::Linear under CPU autocast on a 1 x 2 (DP x TP) mesh: no dtype error, bf16 output, and each
// rank's fp32 main grads are its shards of the golden's (the unparallelized model through
// torch::nn::functional::linear under the same autocast). Tolerance: the TP run sums fc2's two bf16
// partial outputs (and the input gradients of fc1's copy) in bf16 across ranks where the golden
// forms one bf16 GEMM: a few bf16 roundings of values of the activations' size, so rtol 2^-5 and
// atol 2^-7.
TEST(LinearWithGradInBuffer, TpLinearUnderCpuAutocastMatchesTheGoldenOnOneByTwo) {
  TpMlp golden;
  const torch::Tensor x = input(3);
  torch::Tensor golden_out;
  {
    CpuAutocast autocast;
    const auto h = torch::tanh(torch::nn::functional::linear(x, golden->fc1->weight, golden->fc1->bias));
    golden_out = torch::nn::functional::linear(h, golden->fc2->weight, golden->fc2->bias);
  }
  loss_of(golden_out).backward();
  run_on_mesh({1, 2}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
    TpMlp model = tp_copy_of(golden, mesh);
    DistributedDataParallel ddp(model.ptr(), mesh, "dp");
    ddp.zero_grad_buffer();
    torch::Tensor out;
    {
      CpuAutocast autocast;
      out = ddp.forward(x);
    }
    ASSERT_EQ(out.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::allclose(out.to(torch::kFloat), golden_out.to(torch::kFloat), 1.0 / 32, 1.0 / 128));
    loss_of(out).backward();
    ddp.finish_grad_sync();
    expect_main_grads_are_golden_shards(ddp, golden, mesh, 1.0 / 32, 1.0 / 128);
    EXPECT_EQ(ddp.grad_buffer()->stats().grads_written_in_place,
              3);  // fc2.bias (added after the TP sum) goes through autograd
  });
}

// Double backward (a gradient penalty: autograd::grad(create_graph) for the input, then the squared
// input gradient's backward) under CPU autocast reaches the weight as through
// torch::nn::functional::linear: the weight's cast is re-made with its graph in a backward that
// records one (it was made under no-grad in the forward, so the weight got no second-order
// gradient at all). Tolerance: the same bf16 ops on the same casts on both sides, rtol 2^-7.
TEST(LinearWithGradInBuffer, GradientPenaltyUnderCpuAutocastReachesTheWeightAsFunctionalLinear) {
  InBufferLinear model;
  const torch::Tensor w0 = model->fc->weight.detach().clone().requires_grad_(true);
  const torch::Tensor b0 = model->fc->bias.detach().clone().requires_grad_(true);
  const auto penalty = [](const torch::Tensor& x, const std::function<torch::Tensor(const torch::Tensor&)>& f) {
    torch::Tensor out;
    {
      CpuAutocast autocast;
      out = f(x);
    }
    const torch::Tensor gx =
        torch::autograd::grad({loss_of(out)}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
    EXPECT_EQ(gx.scalar_type(), torch::kFloat);
    loss_of(gx).backward();
  };
  const torch::Tensor x = input(0).requires_grad_(true);
  const torch::Tensor x_ref = x.detach().clone().requires_grad_(true);
  penalty(x, [&](const torch::Tensor& in) { return model->forward(in); });
  penalty(x_ref, [&](const torch::Tensor& in) { return torch::nn::functional::linear(in, w0, b0); });
  ASSERT_TRUE(model->fc->weight.grad().defined()) << "the penalty did not reach the weight";
  EXPECT_EQ(model->fc->weight.grad().scalar_type(), torch::kFloat);
  EXPECT_TRUE(torch::allclose(model->fc->weight.grad(), w0.grad(), 1.0 / 128, 1e-5))
      << model->fc->weight.grad() << "\nvs\n"
      << w0.grad();
  EXPECT_TRUE(torch::allclose(x.grad(), x_ref.grad(), 1.0 / 128, 1e-5)) << x.grad() << "\nvs\n" << x_ref.grad();
}

// A gradient penalty through tp::Linear on a 1 x 2 (DP x TP) mesh: the column-parallel fc1's input
// gradient is all-reduced over TP in its backward (copy_to_tp); with create_graph that all-reduce is
// recorded as reduce_from_tp (its own backward: identity), so the penalty's second-order gradient
// reaches every param as in the golden (the unparallelized model, one process). It was a bare c10d
// all-reduce that cut the path: fc1.weight got none of it. Tolerance: fp32, the TP ranks' partial
// sums are added in another order than the golden's GEMMs: rtol 1e-5, atol 1e-6.
TEST(LinearWithGradInBuffer, TpLinearGradientPenaltyMatchesTheGoldenOnOneByTwo) {
  TpMlp golden;
  const auto penalty = [](const torch::Tensor& x, const std::function<torch::Tensor(const torch::Tensor&)>& f) {
    const torch::Tensor gx =
        torch::autograd::grad({loss_of(f(x))}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
    loss_of(gx).backward();
  };
  const torch::Tensor x_ref = input(4).requires_grad_(true);
  penalty(x_ref, [&](const torch::Tensor& in) {
    const auto h = torch::tanh(torch::linear(in, golden->fc1->weight, golden->fc1->bias));
    return torch::linear(h, golden->fc2->weight, golden->fc2->bias);
  });
  run_on_mesh({1, 2}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
    TpMlp model = tp_copy_of(golden, mesh);
    DistributedDataParallel ddp(model.ptr(), mesh, "dp");
    ddp.zero_grad_buffer();
    const torch::Tensor x = x_ref.detach().clone().requires_grad_(true);
    penalty(x, [&](const torch::Tensor& in) { return ddp.forward(in); });
    ddp.finish_grad_sync();
    EXPECT_TRUE(torch::allclose(x.grad(), x_ref.grad(), 1e-5, 1e-6)) << "input gradient";
    expect_main_grads_are_golden_shards(ddp, golden, mesh, 1e-5, 1e-6);
  });
}
