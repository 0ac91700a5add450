// The fused optimizer pass (optimizer/fused_step.h) against today's ATen paths on one flat fp32
// shard of N elements, for the decision in docs/reference/gpu.md (which path DistributedOptimizer uses where)
// and the GPU figures (docs/reference/gpu.md). Per N it times, best of --reps after --warmup:
//   foreach   DistributedOptimizer's foreach AdamW sequence + the bf16 cast-copy of the master
//   aten_fused  at::_fused_adamw_ + the cast-copy (CUDA only: ATen has no CPU fused AdamW kernel here)
//   fused     fused_adamw_step writing the bf16 param in the same pass
//   stats_aten  linalg_vector_norm + isfinite count (the two passes step() would need)
//   stats_fused fused_grad_stats (one pass)
// and the bytes each fused pass moves (AdamW: 4 fp32 reads, 3 fp32 + 1 bf16 writes = 30 B/element;
// stats: 4 B/element) divided by its time, for the fraction of the device's memory bandwidth.
//   build/bench/fused_step_bench --device cpu --numel 1000000,10000000
//   build/bench/fused_step_bench --device cuda --numel 10000000,100000000,1000000000
#include "examples/common/flags.h"
#include "optimizer/fused_step.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#ifdef MESHDDP_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace {

void sync(const at::Device& device) {
#ifdef MESHDDP_WITH_CUDA
  if (device.is_cuda()) c10::cuda::device_synchronize();
#endif
}

double best_ms(const at::Device& device, int warmup, int reps, const std::function<void()>& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    sync(device);
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    sync(device);
    best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) out.push_back(examples::parse_int_flag("--numel", item, 1));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string device_name = "cpu", numels = "1000000,10000000";
  int warmup = 2, reps = 5;
  const std::string usage = "[--device cpu|cuda] [--numel a,b,...] [--warmup N] [--reps N]";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") examples::exit_with_help(argv[0], usage);
    if (i + 1 >= argc) examples::exit_with_usage(argv[0], "flag " + arg + " needs a value", usage);
    const std::string v = argv[++i];
    try {
      if (arg == "--device")
        device_name = examples::parse_choice_flag(arg, v, {"cpu", "cuda"});
      else if (arg == "--numel")
        numels = v;
      else if (arg == "--warmup")
        warmup = static_cast<int>(examples::parse_int_flag(arg, v, 0, INT32_MAX));
      else if (arg == "--reps")
        reps = static_cast<int>(examples::parse_int_flag(arg, v, 1, INT32_MAX));
      else
        examples::exit_with_usage(argv[0], "unknown flag " + arg, usage);
    } catch (const examples::FlagError& e) {
      examples::exit_with_usage(argv[0], e.what(), usage);
    }
  }
  const at::Device device(device_name == "cuda" ? at::kCUDA : at::kCPU);
  if (device.is_cuda() && !(at::hasCUDA() && meshddp::fused_kernels_available(device))) {
    std::cerr << "fused_step_bench: --device cuda needs a CUDA device and a build with the CUDA kernels\n";
    return 1;
  }
  c10::NoGradGuard no_grad;
  const double lr = 1e-3, wd = 0.1, b1 = 0.9, b2 = 0.999, eps = 1e-8;
  std::cout << "# fused_step_bench on " << device << " (threads " << at::get_num_threads() << "), best of " << reps
            << "; times in ms, GB/s = bytes the fused pass must move / its time\n";
  std::cout << "numel,foreach_ms,aten_fused_ms,fused_ms,fused_GBps,stats_aten_ms,stats_fused_ms,stats_fused_GBps\n";
  for (const int64_t n : parse_list(numels)) {
    const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
    at::Tensor g = at::randn({n}, f32), m = at::zeros({n}, f32), v = at::zeros({n}, f32), master = at::randn({n}, f32);
    at::Tensor param = at::empty({n}, f32.dtype(at::kBFloat16));
    int64_t step = 0;
    std::vector<at::Tensor> P{master}, M{m}, V{v}, G{g};
    const double foreach_ms = best_ms(device, warmup, reps, [&] {
      ++step;
      const double bc1 = 1 - std::pow(b1, static_cast<double>(step)), bc2 = 1 - std::pow(b2, static_cast<double>(step));
      at::_foreach_mul_(P, 1 - lr * wd);
      at::_foreach_mul_(M, b1);
      at::_foreach_add_(M, G, 1 - b1);
      at::_foreach_mul_(V, b2);
      at::_foreach_addcmul_(V, G, G, 1 - b2);
      auto denom = at::_foreach_sqrt(V);
      at::_foreach_div_(denom, std::sqrt(bc2));
      at::_foreach_add_(denom, eps);
      at::_foreach_addcdiv_(P, M, denom, -lr / bc1);
      param.copy_(master);
    });
    double aten_fused_ms = NAN;
    if (device.is_cuda()) {
      // As torch.optim.AdamW(fused=True) steps: the step count is incremented on the device first
      // (_fused_adamw_ reads it; at 0 the bias correction would divide by zero).
      at::Tensor steps = at::zeros({}, f32);
      aten_fused_ms = best_ms(device, warmup, reps, [&] {
        steps.add_(1);
        at::_fused_adamw_({master}, {g}, {m}, {v}, {}, {steps}, lr, b1, b2, wd, eps, false, false);
        param.copy_(master);
      });
    }
    const double fused_ms = best_ms(device, warmup, reps, [&] {
      ++step;
      meshddp::fused_adamw_step(g, m, v, master, param, meshddp::adamw_scalars(lr, wd, b1, b2, eps, step));
    });
    const at::Tensor out = at::zeros({2}, f32.dtype(at::kDouble));
    const double stats_aten_ms = best_ms(device, warmup, reps, [&] {
      out[1] += at::linalg_vector_norm(g, 2).to(at::kDouble);
      out[0] += at::isfinite(g).logical_not().sum().to(at::kDouble);
    });
    const double stats_fused_ms = best_ms(device, warmup, reps, [&] { meshddp::fused_grad_stats(g, out); });
    std::cout << n << "," << foreach_ms << "," << aten_fused_ms << "," << fused_ms << ","
              << 30.0 * static_cast<double>(n) / (fused_ms * 1e6) << "," << stats_aten_ms << "," << stats_fused_ms
              << "," << 4.0 * static_cast<double>(n) / (stats_fused_ms * 1e6) << "\n";
  }
  return 0;
}
