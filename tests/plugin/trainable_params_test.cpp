// Which params DistributedDataParallel trains is fixed when it is built: a param frozen or unfrozen
// afterwards is refused, naming it, before an optimizer could apply a zero (or unsynced) gradient;
// params that cannot live in a flat buffer (sparse, meta) are refused at wrap time, naming them, and
// a sparse gradient (an embedding with sparse=True) where it arrives.
#include "grad_buffer/grad_buffer.h"
#include "plugin/distributed_data_parallel.h"
#include "tests/support/error_of.h"
#include "tests/support/mlp.h"
#include "tests/support/rank_threads.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

using namespace meshddp;
using namespace meshddp::test;
using ::testing::HasSubstr;

namespace {

// One training step on rank `rank` of 2; returns the error finish_grad_sync() throws, or "(no error)"
// after stepping `opt`.
std::string step(DistributedDataParallel<MlpImpl>& ddp, torch::optim::Optimizer& opt, int64_t rank, int64_t n) {
  const auto [x, y] = make_batch(5, n, 8, 4, 2);
  torch::nn::functional::mse_loss(ddp.forward(shard_rows(x, rank, 2)), shard_rows(y, rank, 2)).backward();
  return error_of([&] {
    ddp.finish_grad_sync();
    opt.step();
  });
}

}  // namespace

// requires_grad_(false) on a wrapped param: finish_grad_sync() throws on every rank naming it (with
// the old code it synced a zero gradient and AdamW's weight decay moved the "frozen" weight), the
// weight is not moved, and the next zero_grad_buffer() refuses too.
TEST(DistributedDataParallel, RefusesAParamFrozenAfterWrappingNamingItAndNeverMovesIt) {
  run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(1, 4, 8, 2);
    DistributedDataParallel ddp(model.ptr(), mesh, "dp");
    torch::optim::AdamW opt(ddp.parameters(), torch::optim::AdamWOptions(0.01).weight_decay(0.1));
    ddp.zero_grad_buffer();
    ASSERT_EQ(step(ddp, opt, mesh.rank(), 0), "(no error)");

    ddp.zero_grad_buffer();
    model->fc2->weight.requires_grad_(false);
    const torch::Tensor before = model->fc2->weight.detach().clone();
    const std::string error = step(ddp, opt, mesh.rank(), 1);
    EXPECT_THAT(error, HasSubstr("GradBuffer::finish_grad_sync(): parameter 'fc2.weight' was trainable when the "
                                 "model was wrapped but now has requires_grad=False (frozen after wrapping)"));
    EXPECT_THAT(error, HasSubstr("set requires_grad before wrapping"));
    EXPECT_TRUE(torch::equal(model->fc2->weight, before)) << "the frozen weight moved";
    EXPECT_THAT(error_of([&] { ddp.zero_grad_buffer(); }),
                HasSubstr("GradBuffer::zero_grad_buffer(): parameter 'fc2.weight' was trainable"));
  });
}

// A param frozen when wrapped (no slot) and unfrozen later: its gradient would reach the optimizer
// unsynced (different on each rank). finish_grad_sync() throws naming it.
TEST(DistributedDataParallel, RefusesAParamUnfrozenAfterWrappingNamingIt) {
  run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(1, 4, 8, 2);
    model->fc1->bias.requires_grad_(false);
    DistributedDataParallel ddp(model.ptr(), mesh, "dp");
    torch::optim::SGD opt(ddp.parameters(), torch::optim::SGDOptions(0.1));
    ddp.zero_grad_buffer();
    ASSERT_EQ(step(ddp, opt, mesh.rank(), 0), "(no error)");

    ddp.zero_grad_buffer();
    model->fc1->bias.requires_grad_(true);
    const torch::Tensor before = model->fc1->bias.detach().clone();
    EXPECT_THAT(step(ddp, opt, mesh.rank(), 1),
                HasSubstr("GradBuffer::finish_grad_sync(): parameter 'fc1.bias' was frozen (requires_grad=False) "
                          "when the model was wrapped but now requires grad (unfrozen after wrapping). It has no slot "
                          "in the gradient buffer, so its gradient would not be averaged across ranks"));
    EXPECT_TRUE(torch::equal(model->fc1->bias, before));
  });
}

namespace {

struct OddParamsImpl : torch::nn::Module {
  explicit OddParamsImpl(torch::Tensor odd) {
    dense = register_parameter("dense", torch::zeros({4}));
    this->odd = register_parameter("odd", std::move(odd));
  }
  torch::Tensor dense, odd;
};
TORCH_MODULE(OddParams);

}  // namespace

// A sparse param and a param on the meta device (a model built without storage) are refused when
// wrapping, naming the param and what to do (torch's own errors named neither).
TEST(DistributedDataParallel, RefusesSparseAndMetaParamsNamingThemAndWhatToDo) {
  run_on_mesh({1}, {"dp"}, [](DeviceMesh& mesh) {
    const torch::Tensor sparse = torch::sparse_coo_tensor(torch::tensor({{0, 2}}), torch::ones({2}), {4});
    OddParams with_sparse(sparse);
    const std::string sparse_error = error_of([&] { DistributedDataParallel ddp(with_sparse.ptr(), mesh, "dp"); });
    EXPECT_THAT(sparse_error, HasSubstr("GradBuffer: parameter 'odd' is a Sparse tensor, but meshddp keeps every "
                                        "parameter in a dense flat buffer; make it dense"));
    EXPECT_THAT(sparse_error, HasSubstr("or keep it out of DistributedDataParallel"));

    OddParams with_meta(torch::empty({4, 4}, torch::TensorOptions().device(torch::kMeta)));
    const std::string meta_error = error_of([&] { DistributedDataParallel ddp(with_meta.ptr(), mesh, "dp"); });
    EXPECT_THAT(meta_error, HasSubstr("GradBuffer: parameter 'odd' is on the meta device"));
    EXPECT_THAT(meta_error, HasSubstr("materialize it first"));
  });
}

namespace {

struct SparseEmbeddingImpl : torch::nn::Module {
  SparseEmbeddingImpl() {
    torch::manual_seed(1);
    emb = register_module("emb", torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 4).sparse(true)));
  }
  torch::Tensor forward(const torch::Tensor& ids) { return emb(ids); }
  torch::nn::Embedding emb{nullptr};
};
TORCH_MODULE(SparseEmbedding);

}  // namespace

// An embedding with sparse gradients (its weight is dense, so the wrap takes it): the backward
// refuses the sparse gradient where it arrives, naming the param and what to do (it crashed in
// torch's "copy_() between dense and sparse Tensors" with no param name).
TEST(DistributedDataParallel, RefusesASparseGradientNamingTheParamAndWhatToDo) {
  run_on_mesh({1}, {"dp"}, [](DeviceMesh& mesh) {
    SparseEmbedding model;
    DistributedDataParallel ddp(model.ptr(), mesh, "dp");
    ddp.zero_grad_buffer();
    const std::string error = error_of([&] { ddp.forward(torch::tensor({1, 3, 3})).sum().backward(); });
    EXPECT_THAT(error, HasSubstr("GradBuffer: parameter 'emb.weight' got a Sparse gradient, but meshddp reduces "
                                 "gradients in a dense flat buffer; use a dense gradient"));
    EXPECT_THAT(error, HasSubstr("sparse(false)"));
  });
}

// A param converted, moved or replaced after wrapping (its slots are fixed at wrap time): the next
// zero_grad_buffer() refuses naming it (before, model->to(kDouble) or a replaced ZeRO-1 param
// trained on silently, the replaced param no longer updated by the optimizer's all-gather).
TEST(DistributedDataParallel, RefusesAParamConvertedOrReplacedAfterWrappingNamingIt) {
  run_on_mesh({1}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp converted = make_mlp(1, 4, 8, 2);
    DistributedDataParallel plain(converted.ptr(), mesh, "dp");
    converted->to(torch::kDouble);
    const std::string dtype_error = error_of([&] { plain.zero_grad_buffer(); });
    EXPECT_THAT(dtype_error, HasSubstr("GradBuffer::zero_grad_buffer(): parameter 'fc1.weight' is now Double on "
                                       "cpu but was Float on cpu when the model was wrapped"));
    EXPECT_THAT(dtype_error, HasSubstr("convert and move the model before wrapping"));

    Mlp replaced = make_mlp(1, 4, 8, 2);
    DdpConfig config;
    config.use_distributed_optimizer = true;
    DistributedDataParallel zero1(replaced.ptr(), mesh, "dp", config);
    zero1.zero_grad_buffer();
    const torch::Tensor param = replaced->named_parameters()["fc2.bias"];
    param.set_data(torch::zeros_like(param));
    const std::string alias_error = error_of([&] { zero1.zero_grad_buffer(); });
    EXPECT_THAT(alias_error, HasSubstr("parameter 'fc2.bias' no longer lives in its place of the distributed "
                                       "optimizer's param buffer"));
  });
}
