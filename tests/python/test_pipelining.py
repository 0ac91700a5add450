"""torch.distributed.pipelining schedules driving meshddp (meshddp.pipelining.PipelineStage): dp 2 x
pp 2 (4 ranks, Gloo, CPU), a 4-layer MLP, 4 micro-batches per DP rank, 3 SGD steps
(pipelining_workers.py; ZBVZeroBubble and DualPipeV in their V placement, rank r holding stages r
and 3 - r),
against one process on the global batch: the last step's gradients and the
params after it, with the schedule's scale_grads on (mean loss) and off (loss pre-divided by the
micro-batch count). Tolerance 3e-7 (fp32; measured 3e-8 on every schedule).

What the cases check:
- torch's GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV schedules with
  meshddp.pipelining.PipelineStage on dp 2 x pp 2 vs one process on the global batch, scale_grads on and off,
  ZeRO-1 with 1F1B, InterleavedZeroBubble, ZBVZeroBubble and DualPipeV: last-step gradients and params after 3
  SGD steps within 3e-7 (measured 3e-8); under data_parallel_sharding_strategy='optim_grads' with 1F1B,
  Interleaved1F1B, InterleavedZeroBubble and ZBVZeroBubble: the params alike (no whole gradient to compare);
  under 'optim_grads_params' (ZeRO-3: params gathered per unit on use) with 1F1B, InterleavedZeroBubble (2 chunks a
  rank, split backward) and DualPipeV (V-shaped, a forward and a backward overlapped): the params after 3 steps
  equal the 'optim_grads' run's bit for bit (the same gradient path; only where the params live differs), the
  'optim' run's and one process's within 3e-7 (measured 3e-8: each micro-batch's reduce-scatter summed in the
  shard instead of one of the summed micro-batches), and after each step's sync and after each optimizer step
  every chunk holds only its param shards (param_storage_bytes() == param_shard_bytes(), half of optim's);
  docs/guide/pipelines.md's torchrun script on 4 ranks; a stage of a module meshddp does not wrap refused
"""

import os
import subprocess
import sys

import pytest

import multiprocess

TOL = 3e-7


@pytest.mark.parametrize("scale_grads", [True, False])
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble",
                                      "ZBVZeroBubble", "DualPipeV"])
def test_schedule_matches_one_process(schedule, scale_grads):
    diffs = multiprocess.run(4, "pipelining_workers.pipelined", schedule=schedule, scale_grads=scale_grads)
    assert max(max(d) for d in diffs) < TOL, diffs


def test_the_docs_torchrun_script_trains_on_4_ranks():
    """docs/guide/pipelines.md's script (tests/docs/snippets/torch_pipelining.py) under torchrun, dp 2 x pp 2."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = subprocess.run([torchrun, "--standalone", "--nproc-per-node=4",
                          os.path.join(root, "tests/docs/snippets/torch_pipelining.py")],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0 and out.stdout.count(" ok") == 4, out.stdout + out.stderr


@pytest.mark.parametrize("schedule", ["1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_zero1_matches_one_process(schedule):
    """Each chunk's optimizer a meshddp.DistributedOptimizer (ZeRO-1 SGD over the chunk's DP group)."""
    diffs = multiprocess.run(4, "pipelining_workers.pipelined", schedule=schedule, zero1=True)
    assert max(max(d) for d in diffs) < TOL, diffs


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"])
def test_optim_grads_matches_one_process(schedule):
    """Each chunk under data_parallel_sharding_strategy='optim_grads' (gradients sharded, every micro-batch
    reduce-scattered into the shards), stepped by meshddp.DistributedOptimizer: the params (no whole
    gradient exists to compare)."""
    diffs = multiprocess.run(4, "pipelining_workers.pipelined", schedule=schedule, zero1=True, strategy="optim_grads")
    print(f"[{schedule} under optim_grads: max param difference to one process {max(d[1] for d in diffs):.3g}]")
    assert max(d[1] for d in diffs) < TOL, diffs


@pytest.mark.parametrize("schedule", ["1F1B", "InterleavedZeroBubble", "DualPipeV"])
def test_optim_grads_params_matches_optim_grads_and_one_process_holding_only_shards(schedule):
    """Each chunk under data_parallel_sharding_strategy='optim_grads_params', trained beside the same pipeline
    under 'optim' and 'optim_grads' on the same ranks."""
    for rank, r in enumerate(multiprocess.run(4, "pipelining_workers.versus_optim", schedule=schedule)):
        print(f"[{schedule} rank {rank} under optim_grads_params: vs optim_grads {r['vs_optim_grads']:.3g}, vs optim "
              f"{r['vs_optim']:.3g}, vs one process {r['vs_one']:.3g} (optim's {r['optim_vs_one']:.3g}); param storage "
              f"per step (after sync, after step, peak) {r['storage']}, shards {r['shards']}, optim's {r['whole']}]")
        assert r["vs_optim_grads"] == 0.0, f"rank {rank}: params differ from optim_grads's by {r['vs_optim_grads']}"
        assert r["vs_optim"] < TOL and r["vs_one"] < TOL, r
        for step, (synced, stepped, peak) in enumerate(r["storage"]):
            assert synced == r["shards"] and stepped == r["shards"], (
                f"rank {rank} step {step}: param storage after the sync {synced} and after the optimizer step "
                f"{stepped} is not just the shards {r['shards']}: a unit stayed gathered")
            assert all(s < p <= s + w for s, p, w in zip(r["shards"], peak, r["whole"])), (
                f"rank {rank} step {step}: peak param storage {peak} not between the shards {r['shards']} "
                f"(no unit gathered) and shards + whole params {r['whole']}")
        assert all(2 * s == w for s, w in zip(r["shards"], r["whole"])), (r["shards"], r["whole"])


def test_a_stage_of_a_module_meshddp_does_not_wrap_is_refused():
    import torch

    import meshddp.pipelining

    with pytest.raises(RuntimeError, match="submodule must be a meshddp.DistributedDataParallel .* got Linear"):
        meshddp.pipelining.PipelineStage(torch.nn.Linear(2, 2), 0, 2, torch.device("cpu"))
