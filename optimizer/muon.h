// Muon's arithmetic on one whole matrix (the DistributedOptimizer runs it on the matrices a rank owns
// under the whole_param shard policy): momentum, Newton-Schulz orthogonalization, the update scale,
// decoupled weight decay. ATen ops on the matrix's device; no communication.
//
// Note [Muon arithmetic] (torch.optim.Muon, torch/optim/_muon.py, op for op)
//   buf.lerp_(g, 1 - momentum)                       (= momentum * buf + (1 - momentum) * g: an EMA)
//   u = nesterov ? g.lerp(buf, momentum) : buf
//   X = u in the iteration dtype, transposed if rows > cols; X /= max(||X||_F, eps)
//   ns_steps times: A = X X^T; B = b A + c A A (addmm); X = a X + B X (addmm)   (transposed back)
//   p *= 1 - lr * weight_decay; p -= scale(m, n) * lr * X
//   scale: "original" sqrt(max(1, m/n)); "match_rms_adamw" 0.2 sqrt(max(m, n)); "spectral"
//   (Megatron-core's scale_mode) sqrt(max(m, n)) * extra_scale. m, n: the matrix's rows, columns.
//   Coefficients: "torch" (3.4445, -4.7750, 2.0315) every step; "quintic" (Megatron-core / Emerging
//   Optimizers' coefficient_type "quintic", from modded-nanogpt) five per-step triples, the last
//   repeated past step 5.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <functional>
#include <vector>

namespace meshddp {

enum class NsCoefficients { kTorch, kQuintic };
enum class NsDtype { kBFloat16, kFloat32 };  // the dtype the Newton-Schulz iteration runs in
enum class MuonScale { kOriginal, kMatchRmsAdamW, kSpectral };

struct MuonSettings {
  double momentum = 0.95;
  bool nesterov = true;
  int64_t ns_steps = 5;
  NsCoefficients coefficients = NsCoefficients::kTorch;
  NsDtype ns_dtype = NsDtype::kBFloat16;
  MuonScale scale = MuonScale::kOriginal;
  double extra_scale = 1.0;  // kSpectral only
  double eps = 1e-7;
};

// The (a, b, c) of each of `steps` iterations.
std::vector<std::array<double, 3>> ns_coefficients(NsCoefficients which, int64_t steps);

// The orthogonalized 2-D `update` (Note [Muon arithmetic]), in the iteration dtype.
at::Tensor newton_schulz(const at::Tensor& update, const MuonSettings& s);

// The factor on lr for an m x n matrix.
double muon_lr_scale(const MuonSettings& s, int64_t rows, int64_t cols);

// One step on one matrix: `master` (fp32, rows x cols), `grad` (fp32, same shape), `momentum_buffer`
// (fp32, same shape) are updated in place. `orthogonalize` maps the local update to its orthogonalized
// counterpart (default: newton_schulz on it; a TP-sharded matrix gathers the whole one first), and
// `rows` x `cols` is the whole matrix's shape for the scale rule (default: master's).
using Orthogonalize = std::function<at::Tensor(const at::Tensor& update)>;
void muon_step(const at::Tensor& master, const at::Tensor& grad, const at::Tensor& momentum_buffer, double lr,
               double weight_decay, const MuonSettings& s, const Orthogonalize& orthogonalize = {}, int64_t rows = -1,
               int64_t cols = -1);

}  // namespace meshddp
