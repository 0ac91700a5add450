"""torch.distributed.checkpoint of meshddp's state dicts with CUDA tensors (scripts/gpu_check.sh runs
this; without CUDA every test skips, and with MESHDDP_REQUIRE_GPU=1 fails instead): the cases of
test_dcp.py (dcp_workers.py: ZeRO-1 AdamW on fp32 params, SGD with momentum on bf16 params with fp32
masters, a bias param group, an LR changed mid-run) saved by one spawned rank whose model, optimizer
state and collectives are on its GPU (NCCL, every bucket collective forced), then resumed
  - on the same GPU at world size 1: the same state and the same arithmetic as the uninterrupted run,
    so bit-identical to it, and to resuming from meshddp's own format;
  - at 2 ranks on CPU (Gloo): a checkpoint of CUDA tensors loads into CPU tensors resharded over DP;
    bit-identical to resuming from meshddp's own format, and within test_dcp.py's bounds of the
    uninterrupted CPU run (there the first steps ran on the GPU at one rank; GPU and CPU GEMMs round
    differently, well inside those bounds)."""

import os
import tempfile

os.environ["MESHDDP_FORCE_COLLECTIVES"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

import multiprocess  # noqa: E402
from dcp_workers import CONTINUE, LR, SAVE_AT, VARIANTS  # noqa: E402

if os.environ.get("MESHDDP_REQUIRE_GPU") == "1":
    assert torch.cuda.is_available(), "MESHDDP_REQUIRE_GPU=1 but torch sees no CUDA device"
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: scripts/gpu_check.sh runs this on a GPU")

TOL = {"adamw_fp32": 1e-6, "sgd_bf16": 2e-3}  # test_dcp.py's, for the resume on CPU


@pytest.fixture(scope="module")
def saved_on_gpu():
    with tempfile.TemporaryDirectory() as directory:
        losses = multiprocess.run(1, "dcp_workers.save", _backend="nccl", directory=directory, device="cuda")[0]
        yield directory, losses


@pytest.mark.parametrize("world_size,device", [(1, "cuda"), (2, "cpu")])
def test_a_dcp_checkpoint_of_cuda_tensors_resumes_as_if_never_stopped(saved_on_gpu, world_size, device):
    directory, save_losses = saved_on_gpu
    backend = "nccl" if device == "cuda" else "gloo"
    results = multiprocess.run(world_size, "dcp_workers.resume", _backend=backend, directory=directory, device=device)
    for variant in VARIANTS:
        for rank, r in enumerate(results):
            r = r[variant]
            print(f"[{variant} saved on the GPU, resumed at {world_size} on {device}, rank {rank}: vs uninterrupted "
                  f"{r['vs_full']:.3g}, vs meshddp format {r['vs_own']:.3g}]")
            assert r["loaded"] == {"steps_taken": SAVE_AT, "lr": LR / 2, "bias_wd": 0.0}, r["loaded"]
            assert r["vs_own"] == 0.0, f"rank {rank}: DCP and meshddp's own format resume differently: {r['vs_own']}"
            assert r["dcp_losses"] == r["own_losses"]
            assert len(r["dcp_losses"]) == CONTINUE
            tol = 0.0 if device == "cuda" else TOL[variant]
            assert r["vs_full"] <= tol, f"rank {rank}: params differ from the uninterrupted run by {r['vs_full']}"
            for a, b in zip(save_losses[variant] + r["dcp_losses"], r["full_losses"]):
                assert abs(a - b) <= tol, (save_losses[variant] + r["dcp_losses"], r["full_losses"])
