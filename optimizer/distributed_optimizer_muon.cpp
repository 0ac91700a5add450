// The DistributedOptimizer's Muon step (kind = kMuon) over the matrices this rank owns whole
// (optimizer/muon.h has the arithmetic on one matrix), which params take it, and the check that
// TP-sharded ones can be gathered whole.
//
// Note [Muon on stacked matrices]
// With muon_stacked_matrices, a 3-D param [E, m, n] that muon_adamw_params does not name (torchtitan's
// grouped experts, or this EP rank's local experts of one) is E matrices in one param. The whole_param
// layout keeps it whole on one DP rank (its LPT cost, grad_buffer/whole_param_layout.h, is E times a
// matrix's); its momentum buffer is one state tensor of the param's shape ("momentum_buffer" in
// checkpoints, as a 2-D matrix's). update_muon runs muon_step on each slice [i] by itself, the same
// ops as on a 2-D param of that slice's shape, so a slice's bits equal those of a separate m x n
// param. One launch per slice: a batched Newton-Schulz (bmm / baddbmm) gave the same bits as the
// per-slice mm / addmm on CPU for the shapes tried ([4, 8, 12] to [8, 256, 128]), but is unchecked on
// CUDA, where cuBLAS may choose other kernels for batched GEMMs. A stack that is also TP-sharded is
// refused (choose_muon_params): no gather of its pieces is done.
//
// Note [Muon on TP-sharded matrices]
// A column- or row-parallel weight is orthogonalized whole, so the result does not depend on the TP
// size: its owner (the same DP rank on every TP rank: the layouts are the same) all-gathers the
// update's TP pieces over the TP group, runs Newton-Schulz on the whole matrix, keeps its piece, and
// scales by the whole shape. update_muon launches every such all-gather first (each after its
// matrix's momentum update), runs the matrices that need no gather while they are in flight, then
// waits for each gather in launch order and finishes its matrix. Every TP rank launches the same
// gathers in the same order (the same owned matrices, in shard order).
#include "grad_buffer/grad_buffer.h"
#include "mesh/collectives.h"
#include "mesh/config_fields.h"
#include "mesh/placement.h"
#include "optimizer/distributed_optimizer.h"

#include <ATen/ATen.h>

#include <sstream>

namespace meshddp {

MuonSettings DistributedOptimizer::muon_settings() const {
  return {config_.muon_momentum, config_.muon_nesterov, config_.muon_ns_steps,    config_.muon_ns_coefficients,
          config_.muon_ns_dtype, config_.muon_scale,    config_.muon_extra_scale, config_.muon_eps};
}

void DistributedOptimizer::choose_muon_params() {
  TORCH_CHECK(buffer_->config().shard_policy == kWholeParamShards,
              "DistributedOptimizer: kind = muon orthogonalizes whole matrices, but the gradient buffer's ",
              "shard_policy is '", buffer_->config().shard_policy, "' (shards cut params anywhere); set ",
              "DdpConfig.shard_policy = \"", kWholeParamShards, "\"");
  std::vector<std::string> keep_adamw;
  std::stringstream list(config_.muon_adamw_params);
  for (std::string pattern; std::getline(list, pattern, ',');) {
    // "*embed*, *lm_head*": the space is the list's, not the pattern's (" *lm_head*" matched nothing).
    const size_t first = pattern.find_first_not_of(" \t"), last = pattern.find_last_not_of(" \t");
    if (first != std::string::npos) keep_adamw.push_back(pattern.substr(first, last - first + 1));
  }
  const auto& params = buffer_->params();
  const int64_t matrix_dims = 2, stack_dims = 3;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t dims = params[i].param.dim();
    if (dims != matrix_dims && !(config_.muon_stacked_matrices && dims == stack_dims)) continue;
    bool adamw = false;
    for (const auto& pattern : keep_adamw) adamw = adamw || name_matches(pattern, params[i]);
    if (adamw) continue;
    // Note [Muon on stacked matrices]: each slice must be whole on this rank.
    const Placement placement = buffer_->placement(static_cast<int64_t>(i));
    TORCH_CHECK(dims == matrix_dims || !placement.is_shard() || buffer_->groups().tp_size <= 1,
                "DistributedOptimizer: muon_stacked_matrices = true makes 3-D param '", params[i].name, "' (TP rank ",
                buffer_->groups().tp_rank, "'s sizes ", params[i].param.sizes(),
                ") a stack of Muon matrices, but it is sharded over ", "TP (", placement.str(), " of ",
                placement.tp_size, "), which Muon on stacked matrices does not do; ",
                "keep it on AdamW by adding it to muon_adamw_params (now '", config_.muon_adamw_params,
                "'), or set muon_stacked_matrices = false");
    takes_muon_[i] = true;
  }
  check_muon_tp_pieces(takes_muon_);
}

void DistributedOptimizer::check_muon_tp_pieces(const std::vector<bool>& takes_muon) const {
  // update_muon all-gathers a TP-sharded matrix's pieces into the whole one, which needs the same
  // piece shape on every TP rank; uneven pieces (a dim the TP size does not divide) would reach the
  // all-gather with different sizes (Gloo aborts the process; NCCL reads past the smaller piece).
  const SyncGroups& groups = buffer_->groups();
  if (groups.tp_size <= 1 || !groups.tp) return;
  std::vector<Setting> pieces;
  const auto& params = buffer_->params();
  for (size_t i = 0; i < params.size(); ++i) {
    if (!takes_muon[i] || !buffer_->placement(static_cast<int64_t>(i)).is_shard()) continue;
    const at::Tensor& p = params[i].param;
    pieces.push_back({"Muon matrix '" + params[i].name + "' (this TP rank's piece)",
                      std::to_string(p.size(0)) + " x " + std::to_string(p.size(1))});
  }
  verify_same_settings_across_ranks(*groups.tp, pieces, "DistributedOptimizer",
                                    "the TP pieces of the Muon matrices (kind = muon gathers a TP-sharded matrix "
                                    "whole, which needs equal pieces: choose a TP size that divides the sharded "
                                    "dim, or keep the matrix on AdamW with muon_adamw_params)");
}

void DistributedOptimizer::update_muon() {
  const MuonSettings settings = muon_settings();
  auto matrix = [](const at::Tensor& flat, const MuonMatrix& m) {
    return flat.narrow(0, m.segment.shard_offset, m.segment.numel).view({m.rows, m.cols});
  };
  // Note [Muon on TP-sharded matrices]: every gather launched before any is waited for.
  struct Gather {
    const MuonMatrix* matrix = nullptr;
    at::Tensor local, pieces;  // alive until the wait (Note [Stream lifetimes of collective temporaries])
    Work work;
    std::string what;
  };
  std::vector<Gather> gathers;
  for (const MuonMatrix& m : muon_) {
    if (m.tp_dim < 0) continue;
    c10d::ProcessGroup& tp = *buffer_->groups().tp;
    Gather g;
    g.matrix = &m;
    g.local =
        muon_momentum(matrix(grad32_[m.bucket_shard], m), matrix(state1_[m.bucket_shard], m), settings).contiguous();
    g.pieces = at::empty({tp.getSize() * g.local.numel()}, g.local.options());
    g.what = "the TP pieces of Muon matrix '" + buffer_->params()[m.segment.param].name + "'";
    g.work = all_gather_into(tp, g.pieces, g.local.view({-1}), g.what);
    gathers.push_back(std::move(g));
  }
  // A 2-D matrix is a stack of one; each slice of a stack by itself (Note [Muon on stacked matrices]).
  auto stack = [](const at::Tensor& flat, const MuonMatrix& m) {
    return flat.narrow(0, m.segment.shard_offset, m.segment.numel).view({m.stack, m.rows, m.cols});
  };
  for (const MuonMatrix& m : muon_) {
    if (m.tp_dim >= 0) continue;
    const Group& group = groups_[group_of_[m.segment.param]];
    const at::Tensor master = stack(master_[m.bucket_shard], m), grad = stack(grad32_[m.bucket_shard], m),
                     buf = stack(state1_[m.bucket_shard], m);
    for (int64_t i = 0; i < m.stack; ++i) {
      muon_step(master[i], grad[i], buf[i], group.lr, group.weight_decay, settings);
    }
  }
  for (Gather& g : gathers) {
    const MuonMatrix& m = *g.matrix;
    c10d::ProcessGroup& tp = *buffer_->groups().tp;
    wait_collective(g.work, tp, g.what);
    const int64_t tp_size = tp.getSize();
    const at::Tensor pieces = g.pieces.view({tp_size, m.rows, m.cols});
    const at::Tensor whole = m.tp_dim == 0 ? pieces.reshape({tp_size * m.rows, m.cols})
                                           : pieces.permute({1, 0, 2}).reshape({m.rows, tp_size * m.cols});
    const int64_t piece = m.tp_dim == 0 ? m.rows : m.cols;
    const at::Tensor ortho = newton_schulz(whole, settings).narrow(m.tp_dim, tp.getRank() * piece, piece);
    const Group& group = groups_[group_of_[m.segment.param]];
    muon_apply(matrix(master_[m.bucket_shard], m), ortho, group.lr, group.weight_decay, settings,
               m.tp_dim == 0 ? tp_size * m.rows : m.rows, m.tp_dim == 1 ? tp_size * m.cols : m.cols);
  }
}

}  // namespace meshddp
