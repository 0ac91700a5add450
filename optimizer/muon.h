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

// The first steps of Note [Muon arithmetic]: `momentum_buffer` (fp32) updated in place from `grad`;
// returns the update u to orthogonalize.
at::Tensor muon_momentum(const at::Tensor& grad, const at::Tensor& momentum_buffer, const MuonSettings& s);

// The last step: decoupled weight decay on `master` (fp32, in place), then the orthogonalized update
// `ortho` (master's shape) scaled by lr and the scale rule of the whole matrix's `rows` x `cols`.
void muon_apply(const at::Tensor& master, const at::Tensor& ortho, double lr, double weight_decay,
                const MuonSettings& s, int64_t rows, int64_t cols);

// One step on one whole matrix: `master`, `grad`, `momentum_buffer` (fp32, the same shape); the
// master and the buffer are updated in place. (A TP-sharded matrix: the DistributedOptimizer runs
// the three parts with a TP all-gather between the first two.)
void muon_step(const at::Tensor& master, const at::Tensor& grad, const at::Tensor& momentum_buffer, double lr,
               double weight_decay, const MuonSettings& s);

}  // namespace meshddp
