#include "optimizer/muon.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace meshddp {

std::vector<std::array<double, 3>> ns_coefficients(NsCoefficients which, int64_t steps) {
  static constexpr std::array<std::array<double, 3>, 5> kQuintic{{{4.0848, -6.8946, 2.9270},
                                                                  {3.9505, -6.3029, 2.6377},
                                                                  {3.7418, -5.5913, 2.3037},
                                                                  {2.8769, -3.1427, 1.2046},
                                                                  {2.8366, -3.0525, 1.2012}}};
  std::vector<std::array<double, 3>> out;
  for (int64_t i = 0; i < steps; ++i) {
    out.push_back(which == NsCoefficients::kTorch ? std::array<double, 3>{3.4445, -4.7750, 2.0315}
                                                  : kQuintic[std::min<int64_t>(i, 4)]);
  }
  return out;
}

at::Tensor newton_schulz(const at::Tensor& update, const MuonSettings& s) {
  TORCH_CHECK(update.dim() == 2, "newton_schulz: the update must be a matrix, got sizes ", update.sizes());
  const bool transpose = update.size(0) > update.size(1);
  at::Tensor x = update.to(s.ns_dtype == NsDtype::kBFloat16 ? at::kBFloat16 : at::kFloat);
  if (transpose) x = x.t();
  x = x.div(x.norm().clamp(s.eps));  // not in place: for fp32, `x` may still be the caller's tensor (the buffer)
  for (const auto& [a, b, c] : ns_coefficients(s.coefficients, s.ns_steps)) {
    const at::Tensor gram = at::mm(x, x.t());
    const at::Tensor poly = at::addmm(gram, gram, gram, /*beta=*/b, /*alpha=*/c);
    x = at::addmm(x, poly, x, /*beta=*/a);
  }
  return transpose ? x.t() : x;
}

double muon_lr_scale(const MuonSettings& s, int64_t rows, int64_t cols) {
  const auto m = static_cast<double>(rows), n = static_cast<double>(cols);
  switch (s.scale) {
    case MuonScale::kOriginal:
      return std::sqrt(std::max(1.0, m / n));
    case MuonScale::kMatchRmsAdamW:
      return 0.2 * std::sqrt(std::max(m, n));
    case MuonScale::kSpectral:
      return std::sqrt(std::max(m, n)) * s.extra_scale;
  }
  TORCH_INTERNAL_ASSERT(false, "a MuonScale without a rule");
}

at::Tensor muon_momentum(const at::Tensor& grad, const at::Tensor& momentum_buffer, const MuonSettings& s) {
  momentum_buffer.lerp_(grad, 1 - s.momentum);
  return s.nesterov ? grad.lerp(momentum_buffer, s.momentum) : momentum_buffer;
}

void muon_apply(const at::Tensor& master, const at::Tensor& ortho, double lr, double weight_decay,
                const MuonSettings& s, int64_t rows, int64_t cols) {
  master.mul_(1 - lr * weight_decay);
  master.add_(ortho, -lr * muon_lr_scale(s, rows, cols));
}

void muon_step(const at::Tensor& master, const at::Tensor& grad, const at::Tensor& momentum_buffer, double lr,
               double weight_decay, const MuonSettings& s) {
  const at::Tensor ortho = newton_schulz(muon_momentum(grad, momentum_buffer, s), s);
  muon_apply(master, ortho, lr, weight_decay, s, master.size(0), master.size(1));
}

}  // namespace meshddp
