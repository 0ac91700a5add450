// DistributedDataParallel's construction checks and step-order errors, each message asserted, plus
// bf16 params with fp32 main grads against the golden.
#include "grad_buffer/grad_buffer.h"
#include "plugin/distributed_data_parallel.h"
#include "plugin/tp_dim.h"
#include "tests/support/error_of.h"
#include "tests/support/mlp.h"
#include "tests/support/rank_threads.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

using namespace meshddp;
using namespace meshddp::test;
using ::testing::HasSubstr;

using meshddp::test::error_of;

namespace {}  // namespace

TEST(DistributedDataParallel, RejectsModelsThatDifferAcrossRanksNamingTheParamAndRanks) {
  run_on_mesh({2, 2}, {"dp", "tp"}, [](DeviceMesh& mesh) {
    // Global rank 2 (DP rank 1 of the DP group {0, 2}) builds a wider hidden layer.
    const int64_t hidden = mesh.rank() == 2 ? 9 : 8;
    Mlp model = make_mlp(1, 4, hidden, 2);
    auto msg = error_of([&] { DistributedDataParallel ddp(model.ptr(), mesh, "dp"); });
    if (mesh.coordinate("tp") == 0) {
      EXPECT_THAT(msg, HasSubstr("the model differs across data-parallel ranks"));
      EXPECT_THAT(msg, HasSubstr("'fc1.weight' Float [8, 4] trainable on DP rank 0 (global rank 0)"));
      EXPECT_THAT(msg, HasSubstr("'fc1.weight' Float [9, 4] trainable on DP rank 1 (global rank 2)"));
    } else {
      // The DP group {1, 3} agrees, but every rank of the mesh stops (all or nothing): otherwise
      // these two would go on alone and hang in the next mesh-wide collective.
      EXPECT_THAT(msg, HasSubstr("the model differs across the data-parallel ranks of another DP group of this mesh "
                                 "(2 rank(s) report it"));
    }
  });
}

TEST(DistributedDataParallel, RejectsAMissingParamNamingIt) {
  run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(1, 4, 8, 2, /*with_side=*/mesh.rank() == 1);
    auto msg = error_of([&] { DistributedDataParallel ddp(model.ptr(), mesh, "dp"); });
    EXPECT_THAT(msg, HasSubstr("parameter #4 is 'fc3.weight' Float [2, 8] trainable on DP rank 0"));
    EXPECT_THAT(msg, HasSubstr("'side.weight' Float [8, 8] trainable on DP rank 1"));
    EXPECT_THAT(msg, HasSubstr("6 vs 8 parameters in all"));
  });
}

TEST(DistributedDataParallel, ForwardBeforeFinishGradSyncIsAnErrorNamingUnusedParams) {
  run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(1, 4, 8, 2, /*with_side=*/true);
    DistributedDataParallel ddp(model.ptr(), mesh);
    auto x = torch::ones({2, 4});
    ddp.forward(x, /*use_side=*/false).sum().backward();
    auto msg = error_of([&] { ddp.forward(x, false); });
    EXPECT_THAT(msg, HasSubstr("DistributedDataParallel::forward: a new step began before finish_grad_sync()"));
    EXPECT_THAT(msg, HasSubstr("'side.weight', 'side.bias'"));
    ddp.finish_grad_sync();
    ddp.zero_grad_buffer();
    EXPECT_NO_THROW(ddp.forward(x, false));
  });
}

TEST(DistributedDataParallel, NoSyncScopeOnlyAccumulates) {
  run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(1, 4, 8, 2);
    DistributedDataParallel ddp(model.ptr(), mesh, "dp");
    auto x = torch::full({2, 4}, 1.0 + mesh.rank());
    {
      auto guard = ddp.no_sync();
      ddp.forward(x).sum().backward();
      EXPECT_EQ(ddp.grad_buffer()->stats().buckets_launched, 0);
    }
    ddp.forward(x).sum().backward();
    EXPECT_GT(ddp.grad_buffer()->stats().buckets_launched_by_hooks, 0);
    ddp.finish_grad_sync();
  });
}

TEST(DistributedDataParallel, RejectsBadConfigValues) {
  run_on_mesh({1}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(1, 4, 8, 2);
    DdpConfig config;
    config.bucket_bytes = size_t{1} << 45;
    EXPECT_THAT(error_of([&] { DistributedDataParallel ddp(model.ptr(), mesh, "dp", config); }),
                HasSubstr("GradBufferConfig: bucket_bytes = 35184372088832"));
    EXPECT_THAT(error_of([&] { DistributedDataParallel ddp(model.ptr(), mesh, "data"); }),
                HasSubstr("unknown dim name 'data'"));
  });
}

// bf16 params, fp32 main grads. Golden: the same bf16 model on the whole batch. Both update
// p <- bf16(fp32(p) - lr * g). Tolerance: the golden's gradient is rounded to bf16 once
// (rel. 2^-8); the distributed one is a fp32 mean of per-rank bf16 gradients, so gradients agree to
// ~2^-7 relative; the update lr * g is far below a bf16 ulp of the weights' error budget, so params
// agree but for rare one-ulp rounding flips. Measured max |diff| after 20 steps: 9.8e-4 (one ulp in
// [0.25, 0.5)); we allow 8e-3 = two bf16 ulps for weights below 1.
TEST(DistributedDataParallel, Bf16ParamsWithFp32MainGradsMatchGolden) {
  constexpr int kSteps = 20, kWorld = 4;
  constexpr double lr = 0.05;
  auto golden_model = make_mlp(7, 12, 24, 6);
  golden_model->to(torch::kBFloat16);
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = make_batch(7, step, 32, 12, 6);
    for (auto& p : golden_model->parameters()) p.mutable_grad().reset();
    torch::mse_loss(golden_model->forward(x.to(torch::kBFloat16)).to(torch::kFloat), y).backward();
    torch::NoGradGuard no_grad;
    for (auto& p : golden_model->parameters())
      p.copy_((p.to(torch::kFloat) - lr * p.grad().to(torch::kFloat)).to(torch::kBFloat16));
  }
  std::vector<std::vector<torch::Tensor>> result(kWorld);
  run_on_mesh({kWorld}, {"dp"}, [&](DeviceMesh& mesh) {
    auto model = make_mlp(7, 12, 24, 6);
    model->to(torch::kBFloat16);
    DdpConfig config;
    config.grad_reduce_in_fp32 = true;
    config.bucket_bytes = 512;
    DistributedDataParallel ddp(model.ptr(), mesh, "dp", config);
    auto names = model->named_parameters();
    for (int step = 0; step < kSteps; ++step) {
      ddp.zero_grad_buffer();
      auto [x, y] = make_batch(7, step, 32, 12, 6);
      auto xs = shard_rows(x, mesh.rank(), kWorld).to(torch::kBFloat16);
      torch::mse_loss(ddp.forward(xs).to(torch::kFloat), shard_rows(y, mesh.rank(), kWorld)).backward();
      ddp.finish_grad_sync();
      torch::NoGradGuard no_grad;
      for (auto& item : names) {
        const auto& g = ddp.main_grad(item.key());
        EXPECT_EQ(g.scalar_type(), torch::kFloat);
        item.value().copy_((item.value().to(torch::kFloat) - lr * g).to(torch::kBFloat16));
      }
    }
    for (auto& p : model->parameters()) result[mesh.rank()].push_back(p.detach().to(torch::kFloat));
  });
  auto golden = golden_model->parameters();
  double max_diff = 0;
  for (size_t i = 0; i < golden.size(); ++i) {
    auto diff = (result[0][i] - golden[i].to(torch::kFloat)).abs().max().item<double>();
    max_diff = std::max(max_diff, diff);
    EXPECT_LE(diff, 8e-3) << "param " << i;
    EXPECT_TRUE(torch::equal(result[0][i], result[3][i]));
  }
  std::cout << "[ bf16: max |ddp - golden| = " << max_diff << " ]" << std::endl;
}

// Settings that differ across ranks would pair a reduce-scatter with an all-reduce (a SIGABRT
// inside Gloo) or mismatched buckets: DDP compares them over the whole mesh before any such
// collective and names the setting and every rank's value.
TEST(DistributedDataParallel, RejectsSettingsThatDifferAcrossRanksNamingTheSettingAndEachRanksValue) {
  run_on_mesh({2, 2}, {"dp", "tp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(1, 4, 8, 2);
    DdpConfig config;
    config.use_distributed_optimizer = mesh.rank() == 3;
    EXPECT_THAT(error_of([&] { DistributedDataParallel ddp(model.ptr(), mesh, "dp", config); }),
                HasSubstr("the DdpConfig settings differ across the ranks of group 'meshddp/world/ranks=0,1,2,3' "
                          "(rank " +
                          std::to_string(mesh.rank()) +
                          " of 4): 'use_distributed_optimizer' is rank 0: false, rank 1: false, rank 2: false, "
                          "rank 3: true"));
  });
  run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(1, 4, 8, 2);
    DdpConfig config;
    config.bucket_bytes = mesh.rank() == 0 ? 1024 : 2048;
    EXPECT_THAT(error_of([&] { DistributedDataParallel ddp(model.ptr(), mesh, "dp", config); }),
                HasSubstr("'bucket_bytes' is rank 0: 1024, rank 1: 2048"));
  });
  // check_for_nan_in_grad adds an all-reduce to finish_grad_sync(): ranks that differ in it would
  // hang there, so it is compared with the rest (every field of kDdpConfigFields is).
  run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(1, 4, 8, 2);
    DdpConfig config;
    config.check_for_nan_in_grad = mesh.rank() == 1;
    EXPECT_THAT(error_of([&] { DistributedDataParallel ddp(model.ptr(), mesh, "dp", config); }),
                HasSubstr("'check_for_nan_in_grad' is rank 0: false, rank 1: true"));
  });
}

// One rule for which mesh dim is TP (the Python package calls the same function).
TEST(DistributedDataParallel, TheTpDimIsTheOneOtherDimWithMoreThanOneRank) {
  EXPECT_EQ(tp_dim_of({"dp", "tp"}, {2, 2}, "dp"), "tp");
  EXPECT_EQ(tp_dim_of({"dp", "tp"}, {2, 1}, "dp"), "");
  EXPECT_EQ(tp_dim_of({"dp", "pp", "tp"}, {2, 1, 2}, "dp"), "tp");
  EXPECT_THAT(error_of([] { tp_dim_of({"dp", "pp", "tp"}, {2, 2, 2}, "dp"); }),
              HasSubstr("the mesh (dp=2, pp=2, tp=2) has 2 dims besides the DP dim 'dp' with more than one rank"));
  EXPECT_THAT(error_of([] { tp_dim_of({"dp", "tp"}, {2, 2}, "data"); }),
              HasSubstr("the mesh (dp=2, tp=2) has no dim named 'data'"));
}

// broadcast_buffers (PyTorch's default): each training forward uses DP rank 0's buffers; an
// evaluation forward (no grad) does not broadcast (it may run on one rank only); off, each rank
// keeps its own.
TEST(DistributedDataParallel, BroadcastsBuffersFromDpRankZeroBeforeEachTrainingForward) {
  struct Scaled : torch::nn::Module {
    Scaled() {
      w = register_parameter("w", torch::ones({2}));
      scale = register_buffer("scale", torch::ones({1}));
    }
    torch::Tensor forward(const torch::Tensor& x) { return x * w * scale; }
    torch::Tensor w, scale;
  };
  for (bool broadcast : {true, false}) {
    run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
      auto model = std::make_shared<Scaled>();
      DdpConfig config;
      config.broadcast_buffers = broadcast;
      DistributedDataParallel ddp(model, mesh, "dp", config);
      model->scale.fill_(10.0 + mesh.rank());  // e.g. running statistics that drifted apart
      {
        torch::NoGradGuard no_grad;
        EXPECT_EQ(ddp.forward(torch::ones({2}))[0].item<double>(), 10.0 + mesh.rank())
            << "evaluation broadcasts nothing";
      }
      auto out = ddp.forward(torch::ones({2}));
      EXPECT_EQ(out[0].item<double>(), broadcast ? 10.0 : 10.0 + mesh.rank()) << "rank " << mesh.rank();
      out.sum().backward();
      ddp.finish_grad_sync();
    });
  }
}

// load_state_dict copies every param and buffer (strictly: names and shapes checked first) and
// names what is wrong.
TEST(DistributedDataParallel, LoadStateDictIsStrictAndNamesTheOffendingEntry) {
  run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(1, 4, 8, 2);
    DistributedDataParallel ddp(model.ptr(), mesh, "dp");
    Mlp other = make_mlp(2, 4, 8, 2);
    auto state = other->named_parameters();
    ddp.load_state_dict(state);
    for (const auto& item : other->named_parameters()) {
      EXPECT_TRUE(torch::equal(model->named_parameters()[item.key()], item.value())) << item.key();
    }
    torch::OrderedDict<std::string, torch::Tensor> missing;
    missing.insert("fc1.weight", state["fc1.weight"]);
    EXPECT_THAT(error_of([&] { ddp.load_state_dict(missing); }), HasSubstr("'fc1.bias' is missing from the state"));
    auto wrong = state;
    wrong["fc2.bias"] = torch::zeros({3});
    EXPECT_THAT(error_of([&] { ddp.load_state_dict(wrong); }), HasSubstr("'fc2.bias' has shape [3] but the module's"));
    auto extra = state;
    extra.insert("fc9.weight", torch::zeros({1}));
    EXPECT_THAT(error_of([&] { ddp.load_state_dict(extra); }),
                HasSubstr("'fc9.weight' is not a parameter or buffer of the wrapped module"));
  });
}
