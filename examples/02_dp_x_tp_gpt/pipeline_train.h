// Example 02 on a pipeline (--pp N, --vpp V, --micro-batches M): the tiny GPT cut into pp x vpp model
// chunks (pipeline_model.h), vpp per rank, each wrapped in its own meshddp DistributedDataParallel;
// activations and their gradients move between pipeline ranks by c10d isend/irecv; the schedule
// (pipeline_schedule.h: 1F1B, or interleaved with vpp > 1) holds every chunk's DP gradient sync until
// its last backward micro-batch and starts it there, so it overlaps the other chunks' backward; the
// library's finalize_model_grads finishes it all, with the tied embedding's two copies summed over the
// first and last stage, before the optimizer step. Combines with --tp, --sequence-parallel, --cp,
// --distributed-optimizer, --optimizer muon, --dtype bf16 [--grad-reduce-in-bf16], --loss per-token and
// the checkpoint flags. Mesh dims in Megatron's order: pp outermost, then dp, cp, tp innermost.
// docs/guide/pipelines.md "Example 02 on a pipeline".
#pragma once

#include "examples/02_dp_x_tp_gpt/gpt_flags.h"

namespace gpt {

// The training loop of a pipeline run; returns the exit status (errors are thrown, as main's loop).
int train_pipeline(const Flags& f, int argc, char** argv);

}  // namespace gpt
