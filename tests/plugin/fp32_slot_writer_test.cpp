// write_grad_in_place() and fp32 main grads of bf16 params (grad_reduce_in_fp32): the fp32 slot goes
// only to a writer that says it can fill it (SlotDtypes::kParamDtypeOrFp32), which then accumulates the
// gradient in fp32 without rounding it to bf16 first; any other writer gets nothing and its param
// takes the autograd path, as before. linear_with_grad_in_buffer takes fp32 slots on CUDA only (ATen's
// GEMM with an fp32 output from bf16 operands is CUDA-only; tests/gpu/gpu_test.cpp checks it there), so
// this test writes with its own widening writer (both operands cast to fp32, then an fp32 GEMM: the
// same products, exactly, as a bf16 x bf16 -> fp32 GEMM).
#include "grad_buffer/grad_buffer.h"
#include "grad_buffer/grad_in_place.h"
#include "plugin/distributed_data_parallel.h"
#include "tests/support/rank_threads.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

using namespace meshddp;
using namespace meshddp::test;

namespace {

constexpr int64_t kIn = 16, kOut = 8, kRows = 32;

// y = x W^T in bf16; backward writes dL/dW = g^T x into W's slot through write_grad_in_place with the
// given SlotDtypes, widening the operands to the slot's dtype.
struct WideningLinear : torch::autograd::Function<WideningLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            int64_t accepts) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["accepts"] = accepts;
    return at::linear(x, w);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1], &g = grads[0];
    const auto accepts = static_cast<SlotDtypes>(ctx->saved_data["accepts"].toInt());
    at::Tensor grad_w = write_grad_in_place(
        w,
        [&](const at::Tensor& slot, bool accumulate) {
          at::Tensor wg = g.t().to(slot.scalar_type()).mm(x.to(slot.scalar_type()));
          if (accumulate) {
            slot.add_(wg);
          } else {
            slot.copy_(wg);
          }
        },
        accepts);
    if (!grad_w.defined()) grad_w = g.t().mm(x);
    return {g.mm(w), grad_w, at::Tensor()};
  }
};

struct OneLayerImpl : torch::nn::Module {
  OneLayerImpl() {
    torch::manual_seed(7);
    w = register_parameter("w", torch::randn({kOut, kIn}).to(torch::kBFloat16));
  }
  torch::Tensor forward(torch::Tensor x) { return WideningLinear::apply(x, w, static_cast<int64_t>(accepts)); }
  torch::Tensor w;
  SlotDtypes accepts = SlotDtypes::kParamDtype;
};
TORCH_MODULE(OneLayer);

at::Tensor batch(int64_t micro_batch) {
  torch::manual_seed(100 + micro_batch);
  return torch::randn({kRows, kIn}).to(torch::kBFloat16);
}

// Two micro-batches; returns W's fp32 main grad (times DP 1: no averaging to undo) and how many params
// were written in place in the step.
std::pair<at::Tensor, int64_t> main_grad_after_two_micro_batches(SlotDtypes accepts) {
  at::Tensor main_grad;
  int64_t in_place = -1;
  run_on_mesh({1}, {"dp"}, [&](DeviceMesh& mesh) {
    OneLayer model;
    model->accepts = accepts;
    DdpConfig config;
    config.grad_reduce_in_fp32 = true;
    DistributedDataParallel ddp(model.ptr(), mesh, "dp", config);
    for (int step = 0; step < 2; ++step) {  // the second step starts from stale slots (no zeroing pass)
      ddp.zero_grad_buffer();
      {
        auto no_sync = ddp.no_sync();
        ddp.forward(batch(0)).to(torch::kFloat).pow(2).sum().backward();
      }
      ddp.forward(batch(1)).to(torch::kFloat).pow(2).sum().backward();
      ddp.finish_grad_sync();
    }
    main_grad = ddp.main_grad("w").clone();
    in_place = ddp.grad_buffer()->stats().grads_written_in_place;
  });
  return {main_grad, in_place};
}

// dL/dW of sum(y^2) for one micro-batch: (2y)^T x, in the given dtype from the bf16 operands.
at::Tensor wgrad(int64_t micro_batch, const at::Tensor& w, c10::ScalarType dtype) {
  const at::Tensor x = batch(micro_batch);
  const at::Tensor g = (2 * at::linear(x, w).to(torch::kFloat)).to(torch::kBFloat16);
  return g.t().to(dtype).mm(x.to(dtype));
}

}  // namespace

TEST(GradInPlace, Fp32SlotsOfBf16ParamsGoOnlyToWritersThatTakeThem) {
  const at::Tensor w = OneLayer()->w.detach();
  // Widened in place: both micro-batches' products summed in fp32 (first written, then added).
  const at::Tensor fp32_sum = wgrad(0, w, torch::kFloat) + wgrad(1, w, torch::kFloat);
  // Autograd path: each micro-batch's gradient rounded to bf16, then added into the fp32 slot.
  const at::Tensor bf16_sum =
      wgrad(0, w, torch::kBFloat16).to(torch::kFloat) + wgrad(1, w, torch::kBFloat16).to(torch::kFloat);
  ASSERT_FALSE(torch::equal(fp32_sum, bf16_sum)) << "the two paths must be told apart by their rounding";

  auto [widened, widened_in_place] = main_grad_after_two_micro_batches(SlotDtypes::kParamDtypeOrFp32);
  EXPECT_EQ(widened.scalar_type(), torch::kFloat);
  EXPECT_EQ(widened_in_place, 1) << "the writer that takes fp32 slots must get W's";
  EXPECT_TRUE(torch::equal(widened, fp32_sum)) << "max |diff| " << (widened - fp32_sum).abs().max().item<double>();

  auto [fallback, fallback_in_place] = main_grad_after_two_micro_batches(SlotDtypes::kParamDtype);
  EXPECT_EQ(fallback_in_place, 0) << "a writer in the param's dtype must not get an fp32 slot";
  EXPECT_TRUE(torch::equal(fallback, bf16_sum)) << "max |diff| " << (fallback - bf16_sum).abs().max().item<double>();
}
