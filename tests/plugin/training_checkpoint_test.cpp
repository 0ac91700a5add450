// Whole-training-state checkpoints (plugin/training_checkpoint.h): the tiny GPT saved at 2x2 after 5 steps
// and resumed at 4x1, 1x4 and 2x2 continues the uninterrupted loss curve (plain DDP + AdamW and
// ZeRO-1); frozen params, buffers, torch AdamW state and user values come back at another DP size;
// a changed model is named; a load while a gradient sync is pending is refused.
#include "plugin/training_checkpoint.h"

#include "grad_buffer/grad_buffer.h"
#include "optimizer/distributed_optimizer.h"
#include "plugin/distributed_data_parallel.h"
#include "tests/support/error_of.h"
#include "tests/support/gpt_training.h"
#include "tests/support/mlp.h"
#include "tests/support/rank_threads.h"
#include "tests/support/temp_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <unistd.h>

// The optimizer-only checkpoint (DistributedOptimizer::save_checkpoint / load_checkpoint), deprecated
// for users, is still read, written and tested here.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

using namespace meshddp;
using namespace meshddp::test;
using ::testing::HasSubstr;
using ::testing::Not;

namespace {

std::string scratch_dir(const std::string& name) { return test::fresh_dir("train-ckpt-" + name); }

}  // namespace

// Tolerance: at 2x2 the resumed run is the same computation as the uninterrupted one (bit-exact).
// At 4x1 and 1x4 steps 5..9 sum in another order (DP mean over 4 ranks instead of 2, TP partial
// sums over 1 or 4 ranks): the same fp32 reordering that examples/02's check bounds at rtol 1e-4 over
// 10 steps from scratch; measured here: < 2e-7 relative, so 2e-6 leaves a factor of ten.
TEST(TrainingCheckpoint, ResumingAtFourByOneOneByFourAndTwoByTwoContinuesTheLossCurve) {
  for (bool zero : {false, true}) {
    const std::string dir = scratch_dir(zero ? "gpt-zero" : "gpt");
    GptScenario s{.dp = 2, .tp = 2, .distributed_optimizer = zero, .steps = 10};
    GptScenario save = s;
    save.save_dir = dir;
    save.save_before_step = 5;
    const std::vector<double> uninterrupted = train_gpt_on_mesh(save)[0].losses;
    for (auto [dp, tp] : {std::pair{4, 1}, std::pair{1, 4}, std::pair{2, 2}}) {
      GptScenario resume = s;
      resume.dp = dp;
      resume.tp = tp;
      resume.load_dir = dir;
      resume.first_step = 5;
      const std::vector<double> resumed = train_gpt_on_mesh(resume)[0].losses;
      ASSERT_EQ(resumed.size(), 5u);
      double worst = 0;
      for (int k = 0; k < 5; ++k) {
        const double a = uninterrupted[5 + k], b = resumed[k];
        worst = std::max(worst, std::abs(a - b) / std::abs(a));
        if (dp == 2 && tp == 2) {
          EXPECT_EQ(a, b) << (zero ? "ZeRO-1 " : "") << "2x2 step " << 5 + k;
        } else {
          EXPECT_NEAR(b, a, 2e-6 * std::abs(a)) << (zero ? "ZeRO-1 " : "") << dp << "x" << tp << " step " << 5 + k;
        }
      }
      std::cout << "[ " << (zero ? "ZeRO-1 " : "") << "2x2 -> " << dp << "x" << tp << ": max relative loss diff "
                << worst << " ]" << std::endl;
    }
    std::system(("rm -rf '" + dir + "'").c_str());
  }
}

namespace {

// A module with every kind of state: a trainable Linear, a frozen param and a buffer.
struct StatefulImpl : torch::nn::Module {
  explicit StatefulImpl(c10::ScalarType seen_type = torch::kLong) {
    fc = register_module("fc", torch::nn::Linear(6, 3));
    scale = register_parameter("scale", torch::rand({3}) + 0.5, /*requires_grad=*/false);
    seen = register_buffer("seen", torch::zeros({5}, seen_type));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    seen += 1;
    return fc(x) * scale;
  }
  torch::nn::Linear fc{nullptr};
  torch::Tensor scale, seen;
};
TORCH_MODULE(Stateful);

struct StatefulRank {
  explicit StatefulRank(DeviceMesh& mesh, uint64_t seed, c10::ScalarType seen_type = torch::kLong) {
    {
      static std::mutex mutex;  // the default generator is process-global; ranks are threads
      std::lock_guard<std::mutex> lock(mutex);
      torch::manual_seed(seed);
      model = Stateful(seen_type);
    }
    ddp = std::make_unique<DistributedDataParallel<StatefulImpl>>(model.ptr(), mesh, "dp");
    adamw = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-2));
  }
  void train(int steps) {
    for (int i = 0; i < steps; ++i) {
      ddp->zero_grad_buffer();
      ddp->forward(torch::ones({2, 6}) * (i + 1)).square().sum().backward();
      ddp->finish_grad_sync();
      adamw->step();
    }
  }
  TrainingState state() { return {model.ptr().get(), ddp.get(), nullptr, adamw.get()}; }
  Stateful model{nullptr};
  std::unique_ptr<DistributedDataParallel<StatefulImpl>> ddp;
  std::unique_ptr<torch::optim::AdamW> adamw;
};

}  // namespace

TEST(TrainingCheckpoint, FrozenParamsBuffersAdamWStateAndUserValuesComeBackAtAnotherDpSize) {
  const std::string dir = scratch_dir("stateful");
  std::vector<torch::Tensor> saved;  // rank 0's: fc.weight, fc.bias, scale, seen, exp_avg(fc.weight)
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    StatefulRank rank(mesh, 1);
    rank.train(3);
    save_checkpoint(rank.state(), dir, 3,
                    {{"data_position", int64_t{4096}}, {"lr", 2.5e-4}, {"scheduler", std::string("{\"warmup\": 10}")}});
    if (mesh.rank() == 0) {
      auto& st = static_cast<torch::optim::AdamWParamState&>(
          *rank.adamw->state().find(rank.model->fc->weight.unsafeGetTensorImpl())->second);
      saved = {rank.model->fc->weight.clone(), rank.model->fc->bias.clone(), rank.model->scale.clone(),
               rank.model->seen.clone(), st.exp_avg().clone()};
    }
  });
  run_on_mesh({4}, {"dp"}, [&](DeviceMesh& mesh) {
    StatefulRank rank(mesh, 2);  // initialised differently
    const LoadedCheckpoint loaded = load_checkpoint(rank.state(), dir);
    EXPECT_EQ(loaded.step, 3);
    EXPECT_EQ(std::get<int64_t>(loaded.values.at("data_position")), 4096);
    EXPECT_EQ(std::get<double>(loaded.values.at("lr")), 2.5e-4);
    EXPECT_EQ(std::get<std::string>(loaded.values.at("scheduler")), "{\"warmup\": 10}");
    EXPECT_TRUE(torch::equal(rank.model->fc->weight, saved[0]));
    EXPECT_TRUE(torch::equal(rank.model->fc->bias, saved[1]));
    EXPECT_TRUE(torch::equal(rank.model->scale, saved[2])) << "frozen param";
    EXPECT_TRUE(torch::equal(rank.model->seen, saved[3])) << "buffer";
    auto& st = static_cast<torch::optim::AdamWParamState&>(
        *rank.adamw->state().find(rank.model->fc->weight.unsafeGetTensorImpl())->second);
    EXPECT_TRUE(torch::equal(st.exp_avg(), saved[4]));
    EXPECT_EQ(st.step(), 3);
  });
  std::system(("rm -rf '" + dir + "'").c_str());
}

// tests/data/checkpoint_saved_before_nlohmann_json: the checkpoint the test above saves at step 3,
// saved by the build before checkpoint/ used nlohmann-json (its writer put arrays on one line and
// doubles as %.17g: rank 0's header records values {"lr":0.00025000000000000001,...}, where this
// build writes 0.00025). Its bytes are checked as they are (manifest_crc32c, file CRCs, the recorded
// values compared by content), so it still loads. Tolerance on the params: the same 3 steps
// retrained here; another CPU may vectorize AdamW's fp32 arithmetic differently: 1e-6 relative.
TEST(TrainingCheckpoint, ACheckpointSavedBeforeNlohmannJsonStillLoads) {
  const std::string dir = scratch_dir("before-nlohmann");
  ASSERT_EQ(
      std::system(
          ("cp -r '" MESHDDP_SOURCE_DIR "/tests/data/checkpoint_saved_before_nlohmann_json' '" + dir + "'").c_str()),
      0);
  std::vector<torch::Tensor> retrained;
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    StatefulRank rank(mesh, 1);
    rank.train(3);
    if (mesh.rank() == 0) retrained = {rank.model->fc->weight.clone(), rank.model->fc->bias.clone()};
  });
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    StatefulRank rank(mesh, 2);
    const LoadedCheckpoint loaded = load_checkpoint(rank.state(), dir);
    EXPECT_EQ(loaded.step, 3);
    EXPECT_EQ(std::get<int64_t>(loaded.values.at("data_position")), 4096);
    EXPECT_EQ(std::get<double>(loaded.values.at("lr")), 2.5e-4);
    EXPECT_EQ(std::get<std::string>(loaded.values.at("scheduler")), "{\"warmup\": 10}");
    if (mesh.rank() == 0) {
      EXPECT_TRUE(torch::allclose(rank.model->fc->weight, retrained[0], 1e-6, 1e-7));
      EXPECT_TRUE(torch::allclose(rank.model->fc->bias, retrained[1], 1e-6, 1e-7));
    }
  });
  std::system(("rm -rf '" + dir + "'").c_str());
}

TEST(TrainingCheckpoint, AModelWithATensorMissingExtraOrReshapedIsNamed) {
  const std::string dir = scratch_dir("changed"), old_dir = scratch_dir("changed-old");
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    StatefulRank rank(mesh, 1);
    save_checkpoint(rank.state(), dir, 0);
    rank.model->register_buffer("retired", torch::zeros({2}));  // a model that had one more buffer
    save_checkpoint(rank.state(), old_dir, 0);
  });
  auto error_at_load = [&](const std::string& from, const std::function<void(StatefulImpl&)>& change,
                           c10::ScalarType seen_type = torch::kLong) {
    std::string message = "(no error)";
    run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
      StatefulRank rank(mesh, 1, seen_type);
      change(*rank.model);
      try {
        load_checkpoint({rank.model.ptr().get(), rank.ddp.get(), nullptr, nullptr}, from);
      } catch (const c10::Error& e) {
        if (mesh.rank() == 0) message = e.what_without_backtrace();
      }
    });
    return message;
  };
  EXPECT_THAT(error_at_load(dir, [](StatefulImpl& m) { m.register_buffer("extra", torch::zeros({2})); }),
              HasSubstr("the checkpoint has no 'model/extra' (global shape [2] here)"));
  const std::string model_way_out =
      "The model here is not the one saved: build it with the same modules, names and "
      "sizes as at the save";
  const std::string resized = error_at_load(dir, [](StatefulImpl& m) { m.seen.set_(torch::zeros({7}, torch::kLong)); });
  EXPECT_THAT(resized, HasSubstr("'model/seen' has global shape [5] in the checkpoint but [7] here"));
  EXPECT_THAT(resized, HasSubstr(model_way_out));
  const std::string retyped = error_at_load(dir, [](StatefulImpl&) {}, torch::kInt);
  EXPECT_THAT(retyped, HasSubstr("'model/seen' is I64 in the checkpoint but I32 here. Cast the model to the dtype it "
                                 "was saved in before the load"));
  EXPECT_THAT(retyped, Not(HasSubstr(model_way_out)));
  const std::string retired = error_at_load(old_dir, [](StatefulImpl&) {});
  EXPECT_THAT(retired, HasSubstr("the checkpoint has 'model/retired' (global shape [2]) but this model has no such "
                                 "parameter or buffer"));
  EXPECT_THAT(retired, HasSubstr(model_way_out));
  EXPECT_EQ(error_at_load(dir, [](StatefulImpl&) {}), "(no error)");
  std::system(("rm -rf '" + dir + "' '" + old_dir + "'").c_str());
}

// A load after backward and before finish_grad_sync() (the gradient sync pending) would leave the
// gradients of the old params to be applied to the loaded ones by the next step: both loads refuse it
// on every rank, load nothing, and load once the sync has finished (as the module's load refuses it).
TEST(TrainingCheckpoint, ALoadWhileAGradientSyncIsPendingIsRefusedAndLoadsNothing) {
  const std::string dir = scratch_dir("sync-pending");
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    Mlp model = make_mlp(5, 6, 8, 3);
    DdpConfig config;
    config.use_distributed_optimizer = true;
    DistributedDataParallel<MlpImpl> ddp(model.ptr(), mesh, "dp", config);
    DistributedOptimizer opt(ddp.grad_buffer(), DistributedOptimizerConfig{});
    const TrainingState state{model.ptr().get(), &ddp, &opt, nullptr};
    const auto step = [&](int64_t s) {
      ddp.zero_grad_buffer();
      auto [x, y] = make_batch(5, s, 8, 6, 3);
      torch::mse_loss(ddp.forward(shard_rows(x, mesh.rank(), 2)), shard_rows(y, mesh.rank(), 2)).backward();
    };
    step(0);
    opt.step();
    save_checkpoint(state, dir, 1);
    step(1);
    opt.step();
    step(2);  // backward done, finish_grad_sync() not called
    EXPECT_THAT(error_of([&] { opt.load_checkpoint(dir); }),
                HasSubstr("DistributedOptimizer::load_checkpoint: a new step began before finish_grad_sync()"));
    EXPECT_THAT(error_of([&] { load_checkpoint(state, dir); }),
                HasSubstr("load_checkpoint: a new step began before finish_grad_sync()"));
    EXPECT_EQ(opt.steps_taken(), 2);
    ddp.finish_grad_sync();
    EXPECT_EQ(load_checkpoint(state, dir).step, 1);
    opt.load_checkpoint(dir);
  });
  remove_dir(dir);
}

// A TP-sharded param whose pieces differ in size (63 rows over TP 2: torch.chunk's 32 and 31) trains,
// but the checkpoint format holds equal TP chunks: the save names the tensor, the sharded dim and the
// way out on every rank, and leaves nothing behind.
TEST(TrainingCheckpoint, UnevenTpPiecesAreNamedAtTheSave) {
  const std::string dir = fresh_dir("uneven-tp");
  run_on_mesh({1, 2}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
    const int64_t tp_rank = mesh.coordinate("tp");
    auto model = std::make_shared<torch::nn::LinearImpl>(8, tp_rank == 0 ? 32 : 31);
    set_placement(model->weight, Placement::shard(0, 2, tp_rank));
    set_placement(model->bias, Placement::shard(0, 2, tp_rank));
    DistributedDataParallel ddp(model, mesh);
    const std::string error =
        error_of([&] { save_checkpoint(TrainingState{&*model, &ddp, nullptr, nullptr}, dir, 1); });
    EXPECT_THAT(error, testing::HasSubstr("its TP pieces differ in size there")) << "rank " << mesh.rank();
    EXPECT_THAT(error, testing::HasSubstr("choose a TP size that divides it")) << "rank " << mesh.rank();
  });
  EXPECT_FALSE(std::filesystem::exists(dir + "/step-1")) << "a failed save left its step directory behind";
  remove_dir(dir);
}
