// Buffers inside experts and params owned by one wrapper: a buffer follows the reduction group of the
// module that owns it (broadcast and checkpointed within the expert-data-parallel group when it sits
// inside an expert), a param belongs to one live DDP, expert parallel without declared experts is named
// as such, and a checkpoint save that fails leaves no step directory behind.
//
// The model: on dp 4 with EP 2, EP rank k holds experts {2k, 2k+1}, each a Linear and a buffer `scale`
// (e + 1 for expert e, on the rank that is its expert-DP rank 0; other values elsewhere, which DDP must
// replace), plus a dense Linear and a dense buffer `offset`. The expert's output is scaled by its
// buffer, so a buffer overwritten by another expert's changes the loss and every gradient.
#include "plugin/module_ownership.h"

#include "checkpoint/store.h"
#include "plugin/distributed_data_parallel.h"
#include "plugin/training_checkpoint.h"
#include "tests/support/error_of.h"
#include "tests/support/rank_threads.h"
#include "tests/support/temp_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/stat.h>

using namespace meshddp;
using namespace meshddp::test;

namespace {

constexpr int64_t kDim = 3, kExperts = 4, kDp = 4;

struct ScaledExpertImpl : torch::nn::Module {
  explicit ScaledExpertImpl(float scale_value) {
    fc = register_module("fc", torch::nn::Linear(kDim, kDim));
    scale = register_buffer("scale", torch::full({1}, scale_value));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc(x) * scale; }
  torch::nn::Linear fc{nullptr};
  torch::Tensor scale;
};
TORCH_MODULE(ScaledExpert);

struct MoeWithBuffersImpl : torch::nn::Module {
  // Experts `held` (global indices); `perturb` != 0 gives every param and buffer values DDP must replace.
  MoeWithBuffersImpl(const std::vector<int64_t>& held, float perturb) : held(held) {
    dense = register_module("dense", torch::nn::Linear(kDim, kDim));
    offset = register_buffer("offset", torch::full({1}, 0.5f + perturb));
    experts = register_module("experts", std::make_shared<torch::nn::Module>());
    for (int64_t e : held) {
      by_index.push_back(
          experts->register_module(std::to_string(e), ScaledExpert(static_cast<float>(e + 1) + perturb)));
    }
    torch::NoGradGuard no_grad;
    for (auto& item : named_parameters()) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(std::hash<std::string>{}(item.key()));
      item.value().copy_(torch::randn(item.value().sizes(), gen) + perturb);
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor out = dense(x) + offset;
    for (auto& e : by_index) out = out + e->forward(x);
    return out.square().sum();
  }
  std::vector<int64_t> held;
  torch::nn::Linear dense{nullptr};
  torch::Tensor offset;
  std::shared_ptr<torch::nn::Module> experts;
  std::vector<ScaledExpert> by_index;
};
TORCH_MODULE(MoeWithBuffers);

std::vector<int64_t> experts_of(int64_t ep_rank, int64_t ep) {
  std::vector<int64_t> held;
  for (int64_t e = ep_rank * kExperts / ep; e < (ep_rank + 1) * kExperts / ep; ++e) held.push_back(e);
  return held;
}

// This rank's model at EP `ep` on dp 4: expert-DP rank 0 (DP rank < ep) holds the true values.
MoeWithBuffers make_model(const DeviceMesh& mesh, int64_t ep, bool declare = true) {
  const int64_t d = mesh.coordinate("dp");
  MoeWithBuffers model(experts_of(d % ep, ep), d < ep ? 0.0f : 10.0f * static_cast<float>(d));
  if (declare) {
    for (auto& p : model->experts->parameters()) declare_expert_param(p);
  }
  return model;
}

DdpConfig ep_config(int64_t ep) {
  DdpConfig config;
  config.expert_parallel_size = ep;
  return config;
}

// Every expert buffer holds its own expert's value (e + 1), every dense one DP rank 0's.
void expect_own_buffers(const MoeWithBuffers& model, const DeviceMesh& mesh, const std::string& when) {
  EXPECT_EQ(model->offset.item<float>(), 0.5f) << when << ", rank " << mesh.rank();
  for (size_t i = 0; i < model->held.size(); ++i) {
    EXPECT_EQ(model->by_index[i]->scale.item<float>(), static_cast<float>(model->held[i] + 1))
        << "buffer experts." << model->held[i] << ".scale " << when << ", rank " << mesh.rank();
  }
}

bool path_exists(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0;
}

}  // namespace

TEST(ModuleOwnership, ABufferFollowsTheNearestModuleThatHoldsParams) {
  const auto expert = torch::zeros({1}), dense = torch::zeros({1});
  declare_expert_param(expert);
  const std::vector<NamedTensor> params = {
      {"router.weight", dense}, {"moe.experts.2.fc.weight", expert}, {"moe.experts.2.norm.weight", expert}};
  const std::vector<NamedTensor> buffers = {
      {"moe.experts.2.norm.running_mean", torch::zeros({1})},  // owner: expert
      {"moe.experts.2.scale", torch::zeros({1})},              // all expert params
      {"moe.experts.2.act.cache", torch::zeros({1})},          // no params: up to experts.2
      {"moe.bias", torch::zeros({1})},                         // owner moe: experts only here
      {"pos", torch::zeros({1})}};                             // the whole model
  EXPECT_EQ(expert_buffer_flags(params, buffers), (std::vector<bool>{true, true, true, true, false}));
  // moe holds only experts here; with the router under moe it is mixed, so dense.
  const std::vector<NamedTensor> mixed = {{"moe.router.weight", dense}, {"moe.experts.2.fc.weight", expert}};
  EXPECT_EQ(expert_buffer_flags(mixed, {{"moe.bias", torch::zeros({1})}}), (std::vector<bool>{false}));
}

TEST(ModuleOwnership, BuffersInsideExpertsKeepTheirOwnExpertsValuesAtConstructionAndEveryForward) {
  run_on_mesh({kDp, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
    MoeWithBuffers model = make_model(mesh, 2);
    DistributedDataParallel ddp(model.ptr(), mesh, "dp", ep_config(2));
    expect_own_buffers(model, mesh, "after construction");
    // A buffer changed on expert-DP rank 0 only (as a running statistic would be) reaches its peers.
    {
      torch::NoGradGuard no_grad;
      if (mesh.coordinate("dp") < 2) {
        for (auto& e : model->by_index) e->scale.mul_(2);
      } else {
        for (auto& e : model->by_index) e->scale.fill_(-1);
      }
    }
    ddp.forward(torch::ones({2, kDim})).backward();
    ddp.finish_grad_sync();
    for (size_t i = 0; i < model->held.size(); ++i) {
      EXPECT_EQ(model->by_index[i]->scale.item<float>(), 2.0f * static_cast<float>(model->held[i] + 1))
          << "buffer experts." << model->held[i] << ".scale after a training forward, rank " << mesh.rank();
    }
  });
}

// Saved at EP 2, loaded at EP 2 and EP 4 into models whose buffers hold other values.
TEST(ModuleOwnership, BuffersInsideExpertsAreCheckpointedAsExpertTensors) {
  const std::string dir = fresh_dir("expert-buffers-ckpt");
  run_on_mesh({kDp, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
    MoeWithBuffers model = make_model(mesh, 2);
    DistributedDataParallel ddp(model.ptr(), mesh, "dp", ep_config(2));
    save_checkpoint(TrainingState{&*model, &ddp, nullptr, nullptr}, dir, 1);
  });
  for (int64_t ep : {2, 4}) {
    run_on_mesh({kDp, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
      MoeWithBuffers model = make_model(mesh, ep);
      DistributedDataParallel ddp(model.ptr(), mesh, "dp", ep_config(ep));
      {
        torch::NoGradGuard no_grad;
        for (auto& e : model->by_index) e->scale.fill_(-3);
      }
      load_checkpoint(TrainingState{&*model, &ddp, nullptr, nullptr}, dir);
      expect_own_buffers(model, mesh, "after loading at EP " + std::to_string(ep));
    });
  }
  remove_dir(dir);
}

TEST(ModuleOwnership, ExpertParallelWithNoExpertDeclaredSaysSoAndHowToDeclareOne) {
  run_on_mesh({kDp, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
    MoeWithBuffers model = make_model(mesh, 2, /*declare=*/false);
    const std::string error = error_of([&] { DistributedDataParallel ddp(model.ptr(), mesh, "dp", ep_config(2)); });
    EXPECT_THAT(error, testing::HasSubstr("DdpConfig::expert_parallel_size = 2 but no parameter was declared an "
                                          "expert"))
        << "rank " << mesh.rank();
    EXPECT_THAT(error, testing::HasSubstr("meshddp::declare_expert_param(param)")) << "rank " << mesh.rank();
  });
}

TEST(ModuleOwnership, AParamOfALiveWrapperIsRefusedToASecondOneNamingIt) {
  run_on_mesh({2, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
    MoeWithBuffers model(experts_of(0, 1), 0.0f);
    auto first = std::make_unique<DistributedDataParallel<MoeWithBuffersImpl>>(model.ptr(), mesh);
    EXPECT_THAT(error_of([&] { DistributedDataParallel second(model.ptr(), mesh); }),
                testing::HasSubstr("DistributedDataParallel: parameter 'dense.weight' already belongs to a live "
                                   "meshddp DistributedDataParallel"));
    // A sub-module of the wrapped model too: the name is the one the first wrapper knows.
    EXPECT_THAT(error_of([&] { DistributedDataParallel second(model->dense.ptr(), mesh); }),
                testing::HasSubstr("parameter 'weight' already belongs to a live meshddp DistributedDataParallel "
                                   "(which knows it as 'dense.weight')"));
    first.reset();  // the way out: the first wrapper is gone, the model may be wrapped anew
    DistributedDataParallel again(model.ptr(), mesh);
    again.forward(torch::ones({2, kDim})).backward();
    again.finish_grad_sync();
  });
}

// A save that fails after the step directory was made (one rank's file fails) removes it and says so.
TEST(ModuleOwnership, AFailedCheckpointSaveLeavesNoStepDirectory) {
  const std::string dir = fresh_dir("failed-save");
  run_on_mesh({2, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
    MoeWithBuffers model(experts_of(0, 1), 0.0f);
    DistributedDataParallel ddp(model.ptr(), mesh);
    CheckpointSaveOptions options;
    options.after_file_written = [&](const std::string&) { TORCH_CHECK(mesh.rank() != 1, "disk full (simulated)"); };
    const std::string error =
        error_of([&] { save_checkpoint(TrainingState{&*model, &ddp, nullptr, nullptr}, dir, 3, {}, options); });
    EXPECT_THAT(error, testing::HasSubstr("disk full (simulated)")) << "rank " << mesh.rank();
    if (mesh.rank() == 0) {
      EXPECT_THAT(error, testing::HasSubstr("its step directory was removed"));
    }
  });
  EXPECT_FALSE(path_exists(dir + "/step-3")) << "a failed save left its step directory behind";
  remove_dir(dir);
}

// Pieces that do not cover a tensor (held by one rank of two, saved as if shared): the save names it as
// what it was given, not as a damaged manifest, and leaves nothing behind.
TEST(ModuleOwnership, ASaveGivenPiecesThatDoNotCoverATensorSaysSoAndLeavesNothing) {
  const std::string dir = fresh_dir("uncovered-save");
  run_on_mesh({2, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
    const CheckpointMesh cm{mesh.world(), mesh.rank(), 2, 0, 1};
    std::vector<CheckpointTensor> tensors;
    const torch::Tensor t = torch::arange(8, torch::kFloat);
    if (mesh.rank() == 0) tensors.push_back({"model/experts.0.scale", t.narrow(0, 0, 4), {8}, {}, 0, 4, false});
    CheckpointMeta meta;
    meta.step = 5;
    const std::string error = error_of([&] { save_checkpoint_files(cm, dir, meta, tensors); });
    if (mesh.rank() == 0) {
      EXPECT_THAT(error, testing::HasSubstr("do not make a loadable checkpoint"));
      EXPECT_THAT(error, testing::Not(testing::HasSubstr("damaged or was edited")));
    }
    EXPECT_THAT(error, testing::HasSubstr("nothing was committed")) << "rank " << mesh.rank();
  });
  EXPECT_FALSE(path_exists(dir + "/step-5")) << "a failed save left its step directory behind";
  remove_dir(dir);
}
