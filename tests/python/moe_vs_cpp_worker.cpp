// The C++ half of tests/python/test_moe_python_vs_cpp.py: the MoE of moe_vs_cpp_workers.py trained
// through the C++ API (DistributedDataParallel + DistributedOptimizer with clipping, experts declared
// with declare_expert_param), launched by torchrun. Not a test by itself: it reads the initial values
// and the batches the Python side wrote (torch.save, read with torch::pickle_load), trains, and writes
// per rank what the pytest compares with the Python package's run: the engine's param order, each
// bucket's sharding, the loss, the gradient norm and every param after every step (torch::pickle_save,
// read with torch.load).
//
// The module mirrors the Python one param for param, in the same registration order and under the
// engine's names, so both build the same bucket layout: torchtitan-style, this rank's experts as one
// 3-D param per weight, registered under the name the Python package gives a DTensor's local shard
// ("w1@ep<e>of<EP>"); HF-style, "experts.<global index>.w1". Forward is the same torch ops in the same
// order as moe_vs_cpp_workers.Moe.forward.
//
//   torchrun --standalone --nproc-per-node 4 --no-python moe_vs_cpp_worker <inputs.pt> <out dir> <titan|hf>
//            <ep> <optimizer instances> <comm hook: none|bf16_compress|...>
#include "grad_buffer/grad_buffer.h"
#include "mesh/placement.h"

#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <meshddp/meshddp.h>
#include <string>

namespace {

// The constants of moe_vs_cpp_workers.py.
constexpr int64_t kD = 8, kExperts = 4, kRows = 4, kSteps = 4;
constexpr double kLr = 1e-2, kWeightDecay = 0.1, kClip = 1.2;
constexpr size_t kBucketBytes = 512;

using Inputs = c10::Dict<c10::IValue, c10::IValue>;

torch::Tensor input(const Inputs& inputs, const std::string& name) {
  TORCH_CHECK(inputs.contains(name), "moe_vs_cpp_worker: the inputs file has no tensor '", name, "'");
  return inputs.at(name).toTensor();
}

struct MoeImpl : torch::nn::Module {
  MoeImpl(const Inputs& init, int64_t ep, int64_t ep_rank, bool hf_style)
      : local(kExperts / ep), first(ep_rank * (kExperts / ep)), hf_style(hf_style) {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kD})));
    router = register_module("router", torch::nn::Linear(torch::nn::LinearOptions(kD, kExperts).bias(false)));
    head = register_module("head", torch::nn::Linear(kD, kD));
    torch::NoGradGuard no_grad;
    for (auto& item : named_parameters()) item.value().copy_(input(init, item.key()));
    if (hf_style) {
      auto experts = register_module("experts", std::make_shared<torch::nn::Module>());
      for (int64_t e = first; e < first + local; ++e) {
        auto expert = experts->register_module(std::to_string(e), std::make_shared<torch::nn::Module>());
        for (const char* w : {"w1", "w2"}) {
          declare_expert(expert->register_parameter(w, input(init, w)[e].clone()));
        }
        by_index.push_back(expert);
      }
    } else {
      const std::string shard = "@ep" + std::to_string(ep_rank) + "of" + std::to_string(ep);
      w1 = declare_expert(register_parameter("w1" + shard, input(init, "w1").narrow(0, first, local).clone()));
      w2 = declare_expert(register_parameter("w2" + shard, input(init, "w2").narrow(0, first, local).clone()));
    }
  }

  static torch::Tensor& declare_expert(torch::Tensor& p) {
    meshddp::declare_expert_param(p);
    return p;
  }

  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& xg,
                        const torch::Tensor& yg, double scale) {
    torch::Tensor dense = (head(norm(x)) - y).pow(2).sum() * scale;
    torch::Tensor z = norm(xg);
    torch::Tensor gates = torch::softmax(router(z), -1);
    torch::Tensor a = w1, b = w2;
    if (hf_style) {
      std::vector<torch::Tensor> w1s, w2s;
      for (const auto& e : by_index) {
        w1s.push_back(e->named_parameters(false)["w1"]);
        w2s.push_back(e->named_parameters(false)["w2"]);
      }
      a = torch::stack(w1s);
      b = torch::stack(w2s);
    }
    torch::Tensor hidden = torch::relu(torch::einsum("td,edh->teh", {z, a}));
    torch::Tensor out = torch::einsum("teh,ehd->ted", {hidden, b});
    torch::Tensor err = (out - yg.unsqueeze(1)).pow(2).sum(-1);
    return dense + (err * gates.narrow(1, first, local)).sum() * scale;
  }

  int64_t local, first;
  bool hf_style;
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear router{nullptr}, head{nullptr};
  torch::Tensor w1, w2;                                      // torchtitan-style
  std::vector<std::shared_ptr<torch::nn::Module>> by_index;  // HF-style
};
TORCH_MODULE(Moe);

Inputs read_inputs(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "moe_vs_cpp_worker: cannot open the inputs file '", path, "'");
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return torch::pickle_load(bytes).toGenericDict();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) {
    std::cerr << "usage: " << argv[0] << " <inputs.pt> <out dir> <titan|hf> <ep> <optimizer instances> <comm hook>\n";
    return 2;
  }
  const std::string style = argv[3];
  const int64_t ep = std::atoll(argv[4]), instances = std::atoll(argv[5]);
  if (style != "titan" && style != "hf") {
    std::cerr << "moe_vs_cpp_worker: style must be titan or hf, got '" << style << "'\n";
    return 2;
  }
  try {
    at::set_num_threads(1);
    const int64_t world = std::atoll(std::getenv("WORLD_SIZE") ? std::getenv("WORLD_SIZE") : "1");
    meshddp::DeviceMesh mesh = meshddp::DeviceMesh::from_env({world, 1}, {"dp", "tp"});
    const int64_t rank = mesh.coordinate("dp");
    const Inputs inputs = read_inputs(argv[1]);
    Moe model(inputs, ep, rank % ep, style == "hf");

    meshddp::DdpConfig config;
    config.use_distributed_optimizer = true;
    config.expert_parallel_size = ep;
    config.bucket_bytes = kBucketBytes;
    config.num_distributed_optimizer_instances = instances;
    config.comm_hook = argv[6];
    meshddp::DistributedDataParallel ddp(model.ptr(), mesh, "dp", config);
    meshddp::DistributedOptimizerConfig opt_config;
    opt_config.lr = kLr;
    opt_config.weight_decay = kWeightDecay;
    opt_config.clip_grad_norm = kClip;
    meshddp::DistributedOptimizer opt(ddp.grad_buffer(), opt_config);

    c10::Dict<std::string, torch::Tensor> out;
    const meshddp::GradBuffer& buffer = *ddp.grad_buffer();
    c10::List<std::string> order;
    for (const auto& p : buffer.params()) order.push_back(p.name);
    std::vector<int64_t> sharding;
    for (size_t b = 0; b < buffer.layout().buckets.size(); ++b) {
      const auto& r = buffer.bucket_reduction(static_cast<int64_t>(b));
      sharding.insert(sharding.end(), {r.expert ? 1 : 0, r.shard_size, r.cross_group ? r.cross_group->getSize() : 0});
    }
    out.insert("sharding", torch::tensor(sharding).reshape({-1, 3}));
    std::vector<double> losses, norms;
    const int64_t group = rank / ep * ep * kRows;
    for (int64_t step = 0; step < kSteps; ++step) {
      const torch::Tensor x = input(inputs, "x" + std::to_string(step)), y = input(inputs, "y" + std::to_string(step));
      ddp.zero_grad_buffer();
      torch::Tensor loss = ddp.forward(x.narrow(0, rank * kRows, kRows), y.narrow(0, rank * kRows, kRows),
                                       x.narrow(0, group, ep * kRows), y.narrow(0, group, ep * kRows),
                                       1.0 / static_cast<double>(kRows * kD));
      loss.backward();
      const meshddp::StepResult result = opt.step();
      TORCH_CHECK(!result.skipped, "moe_vs_cpp_worker: step ", step, " was skipped: ", result.report);
      norms.push_back(result.grad_norm);
      opt.finish_param_sync();
      losses.push_back(loss.item<double>());
      for (const auto& item : model->named_parameters()) {
        out.insert(std::to_string(step) + "/" + item.key(), item.value().detach().clone());
      }
    }
    out.insert("losses", torch::tensor(losses, torch::kDouble));
    out.insert("grad_norms", torch::tensor(norms, torch::kDouble));
    const std::vector<char> bytes = torch::pickle_save(c10::ivalue::Tuple::create({out, order}));  // (tensors, order)
    std::ofstream(std::string(argv[2]) + "/rank" + std::to_string(mesh.rank()) + ".pt", std::ios::binary)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  } catch (const std::exception& e) {
    std::cerr << "moe_vs_cpp_worker: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
