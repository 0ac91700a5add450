// An outside trainer built against the installed package (find_package(meshddp), meshddp::meshddp,
// <meshddp/meshddp.h> only). Under torchrun at any world size: DDP of a small MLP over "dp" for a
// few SGD steps; every rank also trains a copy of the model alone on the whole global batch (the
// one-process golden) and checks that both models' params agree after every step. Exit 0 and
// "consumer: ok" on every rank, else exit 1 naming the step and the difference.
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <meshddp/meshddp.h>

namespace {

struct Mlp : torch::nn::Module {
  Mlp()
      : fc1(register_module("fc1", torch::nn::Linear(8, 16))), fc2(register_module("fc2", torch::nn::Linear(16, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};

}  // namespace

int main() {
  const int64_t world = std::atoll(std::getenv("WORLD_SIZE") ? std::getenv("WORLD_SIZE") : "1");
  auto mesh = meshddp::DeviceMesh::from_env({world}, {"dp"});
  const int64_t rank = mesh.rank();
  std::printf("consumer: rank %lld of %lld, meshddp %s (built against torch %s)\n", (long long)rank, (long long)world,
              MESHDDP_VERSION, MESHDDP_BUILT_WITH_TORCH);

  torch::manual_seed(0);
  auto model = std::make_shared<Mlp>();
  auto golden = std::make_shared<Mlp>();
  for (size_t i = 0; i < model->parameters().size(); ++i) {
    torch::NoGradGuard no_grad;
    golden->parameters()[i].copy_(model->parameters()[i]);
  }
  meshddp::DistributedDataParallel ddp(model, mesh, "dp", meshddp::DdpConfig{});
  torch::optim::SGD opt(ddp.parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD golden_opt(golden->parameters(), torch::optim::SGDOptions(0.1));

  const int64_t per_rank = 4;
  for (int step = 0; step < 5; ++step) {
    torch::manual_seed(100 + step);  // the same global batch on every rank
    auto x = torch::randn({per_rank * world, 8});
    auto y = torch::randn({per_rank * world, 4});

    ddp.zero_grad_buffer();
    auto mine =
        torch::mse_loss(ddp.forward(x.narrow(0, rank * per_rank, per_rank)), y.narrow(0, rank * per_rank, per_rank));
    mine.backward();
    ddp.finish_grad_sync();  // grads: the DP mean
    opt.step();

    golden_opt.zero_grad();
    torch::mse_loss(golden->forward(x), y).backward();
    golden_opt.step();

    double worst = 0;
    for (size_t i = 0; i < golden->parameters().size(); ++i) {
      worst = std::max(worst, (model->parameters()[i] - golden->parameters()[i]).abs().max().item<double>());
    }
    // The mean of per-rank means equals the global mean up to float rounding (a few ulp of the
    // params after 5 steps); a missing 1/DP scale or a missing all-reduce is off by ~1e-2.
    if (worst > 1e-5) {
      std::fprintf(stderr, "consumer: rank %lld: step %d: params differ from the one-process golden by %g\n",
                   (long long)rank, step, worst);
      return 1;
    }
  }
  std::printf("consumer: ok (rank %lld)\n", (long long)rank);
  return 0;
}
