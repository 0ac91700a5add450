#include "common/grad_norm.h"

#include "grad_buffer/grad_buffer.h"
#include "grad_buffer/run_stats.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <sstream>

namespace meshddp {

NormPieces norm_pieces(const at::Tensor& flat, const std::vector<GradRun>& runs, int64_t tp_rank) {
  NormPieces pieces;
  for (const GradRun& run : runs) {
    TORCH_INTERNAL_ASSERT(run.placement != nullptr, "norm_pieces: a run without a placement");
    pieces.all_count = pieces.all_count && run.placement->counts_on_tp_rank(tp_rank);
  }
  if (pieces.all_count) {
    pieces.counted.push_back(flat);
    return pieces;
  }
  for (const GradRun& run : runs) {
    auto& into = run.placement->counts_on_tp_rank(tp_rank) ? pieces.counted : pieces.not_counted;
    into.push_back(flat.narrow(0, run.offset, run.numel));
  }
  return pieces;
}

NormPieces norm_pieces(const GradBuffer& buffer) {
  const int64_t tp_rank = buffer.groups().tp_rank;
  NormPieces pieces;
  for (int64_t i = 0; i < static_cast<int64_t>(buffer.params().size()); ++i) {
    const bool counts = buffer.placement(i).counts_on_tp_rank(tp_rank);
    pieces.all_count = pieces.all_count && counts;
    (counts ? pieces.counted : pieces.not_counted).push_back(buffer.main_grad(i));
  }
  return pieces;
}

void add_squared_norms(const std::vector<at::Tensor>& pieces, const at::Tensor& acc) {
  // `acc` may be a view of one element of a larger tensor: add in place, never rebind.
  at::Tensor target = acc;
  for (const at::Tensor& piece : pieces) target += at::linalg_vector_norm(piece, 2).to(at::kDouble).square();
}

namespace {

// The squared L2 norm of one main gradient, in fp64. An fp16 or bf16 gradient's norm is taken in fp32:
// in fp16 it overflows at 65504 though every element is finite (1e5 elements of 300 have norm 9.5e4),
// which would zero every gradient (torch's clip_grad_norm_ does, taking norms in the gradient's dtype),
// and in bf16 it keeps 3 significant digits.
at::Tensor squared_norm(const at::Tensor& grad) {
  const bool reduced = grad.scalar_type() == at::kHalf || grad.scalar_type() == at::kBFloat16;
  const at::Tensor norm =
      reduced ? at::linalg_vector_norm(grad, 2, std::nullopt, false, at::kFloat) : at::linalg_vector_norm(grad, 2);
  return norm.to(at::kDouble).square();
}

void check_plain_ddp(const GradBuffer& buffer, const char* who) {
  TORCH_CHECK(
      !buffer.config().use_distributed_optimizer, "meshddp::", who, ": the grad buffer is sharded for the ",
      "ZeRO-1 distributed optimizer (use_distributed_optimizer), so each DP rank holds the reduced gradient of ",
      "its shard only; set DistributedOptimizerConfig::clip_grad_norm instead (its step() clips and reports ",
      "StepResult::grad_norm)");
}

// "'a.weight', 'b.bias'": this rank's params whose gradient has a NaN or Inf (for the error).
std::string nonfinite_params(const GradBuffer& buffer) {
  std::ostringstream names;
  for (int64_t i = 0; i < static_cast<int64_t>(buffer.params().size()); ++i) {
    if (at::isfinite(buffer.main_grad(i)).all().item<bool>()) continue;
    names << (names.tellp() > 0 ? ", " : "") << describe_param_name(buffer.params()[i]);
  }
  return names.tellp() > 0 ? names.str() : std::string("none (another rank's are)");
}

}  // namespace

namespace {

// The chunks of one run: each plain DDP, none twice, all on one mesh (the same DP and expert-DP sizes
// and pipeline), and every chunk this rank holds on the pipeline.
void check_chunks(const std::vector<GradBufferHandle>& chunks, const char* who) {
  TORCH_CHECK(!chunks.empty(), "meshddp::", who, ": no gradient buffers given; pass each model chunk's ",
              "(DistributedDataParallel::grad_buffer())");
  const SyncGroups& first = chunks.front()->groups();
  for (size_t c = 0; c < chunks.size(); ++c) {
    check_plain_ddp(*chunks[c], who);
    const SyncGroups& g = chunks[c]->groups();
    for (size_t d = 0; d < c; ++d) {
      TORCH_CHECK(&*chunks[d] != &*chunks[c], "meshddp::", who, ": chunk ", c, "'s gradient buffer is chunk ", d,
                  "'s too; pass each model chunk once");
    }
    TORCH_CHECK(g.data_parallel_size() == first.data_parallel_size() && g.pipeline == first.pipeline &&
                    (g.expert_dp ? g.expert_dp->getSize() : 1) == (first.expert_dp ? first.expert_dp->getSize() : 1),
                "meshddp::", who, ": chunk ", c, " is synced over other groups than chunk 0 (DP size ",
                g.data_parallel_size(), " vs ", first.data_parallel_size(),
                "); the chunks of one norm must be wrapped over the same mesh");
  }
  std::vector<const void*> buffers;
  for (const GradBufferHandle& chunk : chunks) buffers.push_back(&*chunk);
  check_every_chunk_given(first, buffers, std::string("meshddp::") + who,
                          std::string("Pass every chunk's gradient buffer in one call: meshddp::") + who +
                              "({chunk0.grad_buffer(), chunk1.grad_buffer(), ...}) (Python: meshddp." + who +
                              "([ddp0, ddp1, ...]))");
}

// "'a.weight', 'b.bias'": this rank's params whose gradient has a NaN or Inf, over every chunk.
std::string nonfinite_params(const std::vector<GradBufferHandle>& chunks) {
  std::string names;
  for (const GradBufferHandle& chunk : chunks) {
    const std::string mine = nonfinite_params(*chunk);
    if (mine.rfind("none", 0) == 0) continue;
    names += (names.empty() ? "" : ", ") + mine;
  }
  return names.empty() ? std::string("none (another rank's are)") : names;
}

}  // namespace

namespace {

// grad_norm over `chunks`; `max_norm` (0 for grad_norm) agreed over the whole run in the same
// all-reduce, so that no stage clips by another bound than the others.
double run_grad_norm(const std::vector<GradBufferHandle>& chunks, double max_norm, const char* who) {
  check_chunks(chunks, who);
  // On the host, as the sum over the run is read there anyway (CPU fp64): [dense params, expert
  // params] (summed apart because they have different replica counts), [max_norm, max_norm^2].
  at::Tensor sum = at::zeros({4}, at::TensorOptions().dtype(at::kDouble));
  const double agreed = std::isfinite(max_norm) ? max_norm : -1.0;  // a NaN would differ from itself
  sum[2] = agreed;
  sum[3] = agreed * agreed;
  for (const GradBufferHandle& buffer : chunks) {
    buffer.finish_grad_sync();
    const SyncGroups& g = buffer->groups();
    const BucketLayout& layout = buffer->layout();
    for (int64_t i = 0; i < static_cast<int64_t>(buffer->params().size()); ++i) {
      if (!buffer->placement(i).counts_on_tp_rank(g.tp_rank)) continue;
      // A weight tied across stages: its two copies hold one summed gradient; the first stage counts it.
      if (layout.buffers[layout.slots[i].buffer].key.tied && !g.counts_tied()) continue;
      sum[buffer->is_expert(i) ? 1 : 0] += squared_norm(buffer->main_grad(i)).cpu();
    }
  }
  const SyncGroups& g = chunks.front()->groups();
  all_reduce_over_run(g, sum, std::string("the gradient norm (meshddp::") + who + ")");
  const int64_t ranks = ranks_in_run(g);
  TORCH_CHECK(same_on_every_rank(sum[2].item<double>(), sum[3].item<double>(), ranks), "meshddp::", who,
              ": max_norm differs across the ranks of the run (this rank ", max_norm, ", ", describe_rank(g),
              "); the mean over every rank is ", sum[2].item<double>() / static_cast<double>(ranks),
              " (0 for a rank calling grad_norm). One run clips by one bound: pass the same max_norm on every ",
              "rank of every stage. Nothing was scaled");
  // The stats group spans DP too, where every rank of a param's reduction group holds the same mean:
  // count it once (Note [Gradient norm over DP x TP]).
  const double expert_replicas = g.expert_dp ? static_cast<double>(g.expert_dp->getSize()) : 1.0;
  return std::sqrt(sum[0].item<double>() / static_cast<double>(g.data_parallel_size()) +
                   sum[1].item<double>() / expert_replicas);
}

}  // namespace

double grad_norm(const std::vector<GradBufferHandle>& chunks) { return run_grad_norm(chunks, 0.0, "grad_norm"); }

double grad_norm(GradBufferHandle buffer) { return grad_norm(std::vector<GradBufferHandle>{buffer}); }

double clip_grad_norm_(const std::vector<GradBufferHandle>& chunks, double max_norm, bool error_if_nonfinite) {
  // Agreed over the run first (a bound bad on one rank fails every rank alike), then validated.
  const double norm = run_grad_norm(chunks, max_norm, "clip_grad_norm_");
  TORCH_CHECK(std::isfinite(max_norm) && max_norm > 0, "meshddp::clip_grad_norm_: max_norm must be positive and ",
              "finite, got ", max_norm);
  if (error_if_nonfinite) {
    const SyncGroups& g = chunks.front()->groups();
    TORCH_CHECK(std::isfinite(norm), "meshddp::clip_grad_norm_: the total norm of order 2 of the gradients is ",
                "non-finite (", norm, "), so it cannot be clipped. Params with non-finite gradients on ",
                describe_stage(g), "DP rank ", g.dp_rank(), ", TP rank ", g.tp_rank, ": ", nonfinite_params(chunks),
                ". Nothing was scaled; skip this step (zero_grad_buffer()), or pass error_if_nonfinite=false to ",
                "scale by the non-finite norm as torch does");
  }
  // torch: clamp(max_norm / (norm + 1e-6), max=1); clamp keeps a NaN, and multiplying by 1 changes nothing.
  const double coef = max_norm / (norm + 1e-6);
  if (coef >= 1.0) return norm;
  c10::NoGradGuard no_grad;
  for (const GradBufferHandle& buffer : chunks) {
    for (int64_t i = 0; i < static_cast<int64_t>(buffer->params().size()); ++i) {
      at::Tensor g = buffer->main_grad(i);
      g.mul_(coef);
    }
  }
  return norm;
}

double clip_grad_norm_(GradBufferHandle buffer, double max_norm, bool error_if_nonfinite) {
  return clip_grad_norm_(std::vector<GradBufferHandle>{buffer}, max_norm, error_if_nonfinite);
}

}  // namespace meshddp
