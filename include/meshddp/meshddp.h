// meshddp's public API, one include: #include <meshddp/meshddp.h> (C++ package: find_package(meshddp)
// and link meshddp::meshddp; docs/reference/cpp_api.md). The front end only: what is not reachable from here is
// internal, is not installed, and may change (tests/build/check_public_headers.py holds the project
// headers reached from here to at most 20 and builds a consumer against the installed ones only).
// A ZeRO-1 step and a checkpoint, given a module `model` (a std::shared_ptr), `dp`, `tp`, a batch `x`,
// `y` and the `step` (compiled as written, into the test docs.readme_cpp_snippet_runs_on_2_ranks):
//
//   auto mesh = meshddp::DeviceMesh::from_env({dp, tp}, {"dp", "tp"});
//   meshddp::DdpConfig config;
//   config.use_distributed_optimizer = true;  // false: plain DDP, step a torch::optim optimizer instead
//   meshddp::DistributedDataParallel ddp(model, mesh, "dp", config);
//   meshddp::DistributedOptimizer opt(ddp.grad_buffer(), meshddp::DistributedOptimizerConfig{});
//   ddp.zero_grad_buffer();
//   torch::mse_loss(ddp.forward(x), y).backward();
//   ddp.finish_grad_sync();
//   opt.step();
//   meshddp::save_checkpoint(meshddp::TrainingState{&ddp.module(), &ddp, &opt}, "ckpt", step);
#pragma once

#include "meshddp/version.h"

// The mesh: an N-D grid of ranks with named dims and a process group per dim.
#include "mesh/device_mesh.h"

// Data parallelism and its config; the ZeRO-1 optimizer and its config (OptimizerConfig), the LR schedule.
#include "optimizer/distributed_optimizer.h"
#include "optimizer/lr_scheduler.h"
#include "plugin/distributed_data_parallel.h"

// Checkpoints of the whole training state: save_checkpoint / load_checkpoint / resume_checkpoint, and
// CheckpointSaver for asynchronous saves.
#include "plugin/checkpoint_saver.h"
#include "plugin/training_checkpoint.h"

// Pipeline controls: a schedule's chunks, finalize_model_grads, pipeline_chunk_config.
#include "plugin/pipeline.h"

// The gradient norm and its clipping for plain DDP over DP x TP (ZeRO-1 clips in its optimizer).
#include "common/grad_norm.h"

// Tensor parallelism: the layers a model is written with, and the plans that parallelize them.
#include "tp/parallelize.h"
#include "tp/tp_layers.h"
