// The global gradient norm over a DP x TP mesh, and gradient clipping by it for plain DDP
// (torch.nn.utils.clip_grad_norm_ for a model that DDP and tensor parallelism have cut up). The one
// place that decides which gradient elements a rank counts (Note [Gradient norm over DP x TP]): the
// ZeRO-1 optimizer (optimizer/distributed_optimizer.cpp) and plain-DDP users (the examples, your
// training loop) all count through norm_pieces().
//
// Why common/: the rule needs only the GradBuffer and the placements below it; the tensor-parallel
// layers (tp/) set those placements, and the ZeRO-1 optimizer and plain-DDP users both count through
// here, so it sits on the floor under both, and a plain-DDP user needs neither floor for a norm. Not
// here: the ZeRO-1 optimizer's own clipping (DistributedOptimizerConfig::clip_grad_norm), which
// scales its fp32 shards.
#pragma once

#include "../grad_buffer/grad_buffer_handle.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace meshddp {

class GradBuffer;  // grad_buffer/grad_buffer.h
struct Placement;  // mesh/placement.h

// Note [Gradient norm over DP x TP]
// The norm of the model's whole gradient counts each element once over the mesh. Over TP: a
// TP-sharded param (Placement::kShard) has a different chunk on each TP rank, so every TP rank
// counts its chunk; a replicated param (and a TP-partial one, summed over TP by the sync) has the
// same gradient on every TP rank, so TP rank 0 alone counts it (Placement::counts_on_tp_rank). Over
// DP: ZeRO-1 shards are disjoint, so every DP rank counts its shard; in plain DDP every DP rank holds
// the whole DP mean, so the sum over the mesh counts it DP times and is divided by the DP size.
// Expert (MoE) params are held by their expert-data-parallel group only (different EP ranks hold
// different experts): in plain DDP their sum is divided by the expert-DP size instead; under ZeRO-1
// their shards are disjoint within that group, so again each element counts once. Tied
// weights are one param in the GradBuffer (deduplicate_params), hence one term. Every rank gets the
// same bits: the sum is one all-reduce over the buffer's stats group (the whole mesh, or on a pipeline
// mesh the stage, then the pipeline group: grad_buffer/run_stats.h). A pipeline is one run: every
// stage's chunks count, and a weight tied across stages (declare_tied_across_stages), whose two copies
// hold one summed gradient, counts on the first stage only.

// A run of a flat gradient (e.g. a ZeRO-1 bucket shard) that belongs to one param.
struct GradRun {
  int64_t offset = 0;  // into the flat tensor
  int64_t numel = 0;
  const Placement* placement = nullptr;  // the param's; not null
};

// The parts of a gradient this rank counts toward the mesh-wide norm, and the parts it does not
// (for callers that also need every element, e.g. a non-finite count).
struct NormPieces {
  bool all_count = true;                // every run counts: `counted` is the whole flat tensor, one piece
  std::vector<at::Tensor> counted;      // in run order
  std::vector<at::Tensor> not_counted;  // in run order
};

// `flat` cut by `runs` for TP rank `tp_rank`: when every run counts, the whole of `flat` as one
// piece (one kernel instead of one per param: TP 1, or TP rank 0), else one piece per run. Pure: no
// kernels, no communication.
NormPieces norm_pieces(const at::Tensor& flat, const std::vector<GradRun>& runs, int64_t tp_rank);

// Plain DDP: each param's main gradient (the whole DP mean, after finish_grad_sync()) as one piece.
NormPieces norm_pieces(const GradBuffer& buffer);

// Adds each piece's squared L2 norm, in fp64, into `acc` (a one-element fp64 tensor on the pieces'
// device, or a view of one element), piece by piece in order.
void add_squared_norms(const std::vector<at::Tensor>& pieces, const at::Tensor& acc);

// Plain DDP (not with use_distributed_optimizer): the L2 norm of the model's whole gradient (the DP
// mean, TP shards joined, each element once: Note [Gradient norm over DP x TP]). Finishes the
// gradient sync first if it has not (a no-op after finish_grad_sync()). One all-reduce over the
// mesh: every rank must call it; every rank gets the same value. NaN or Inf if any gradient element is.
// fp16/bf16 gradients' norms are taken in fp32 (torch takes them in fp16, where a norm past 65504 is Inf).
double grad_norm(GradBufferHandle buffer);
// The same over every model chunk this rank holds (a pipeline with virtual stages: one
// DistributedDataParallel per chunk), each finished first: the norm of the whole pipeline's gradient.
// Throws naming the call when this rank holds more chunks on the pipeline than are given (the single
// overload included: a chunk's own norm is not the run's).
double grad_norm(const std::vector<GradBufferHandle>& chunks);

// torch.nn.utils.clip_grad_norm_(params, max_norm, 2.0, error_if_nonfinite) for plain DDP over a
// DP x TP mesh: the norm of grad_norm(), then every main gradient (param.grad() is a view of it)
// (param.grad() is a view of it; with grad_reduce_in_fp32 the fp32 main gradient)
// scaled by min(max_norm / (norm + 1e-6), 1), torch's formula (a NaN coefficient included: with a
// non-finite norm and error_if_nonfinite false the gradients become NaN, or 0 where the norm is
// Inf, as in torch). With error_if_nonfinite, a non-finite norm throws on every rank (every rank has
// the same norm) naming this rank's params with non-finite gradients, and nothing is scaled.
// Returns the norm before clipping. Every rank must call it, after backward, before the optimizer.
// Throws if the buffer is sharded for the ZeRO-1 optimizer (use DistributedOptimizerConfig::
// clip_grad_norm there) or max_norm is not positive and finite.
double clip_grad_norm_(GradBufferHandle buffer, double max_norm, bool error_if_nonfinite = false);
// The same over every model chunk this rank holds, by the norm of grad_norm(chunks).
double clip_grad_norm_(const std::vector<GradBufferHandle>& chunks, double max_norm, bool error_if_nonfinite = false);

}  // namespace meshddp
