"""meshddp on process groups a user made without a CPU backend: torch's init_process_group("nccl")
registers NCCL for CUDA tensors only, and meshddp's agreement checks, checkpoint agreement and
non-finite report use CPU tensors. Here "cuda:gloo" (Gloo serving CUDA tensors only) stands for
NCCL on this CPU machine: ZeRO-1 construction, training and a checkpoint round trip must work and
match one-process AdamW (same tolerance as test_ddp_vs_torch's ZERO1_TOL)."""

import multiprocess

ZERO1_TOL = 5e-7


def test_zero1_trains_and_checkpoints_on_a_group_without_a_cpu_backend(tmp_path):
    for rank, r in enumerate(multiprocess.run(2, "zero1_on_cuda_only_group", _backend="cuda:gloo",
                                              checkpoint_dir=str(tmp_path / "ckpt"))):
        assert r["device_types_before"] == ["cuda"], r["device_types_before"]
        assert r["device_types_after"] == ["cpu", "cuda"], r["device_types_after"]
        assert r["param_diff"] <= ZERO1_TOL, f"rank {rank}: params differ from torch.optim.AdamW's by {r['param_diff']}"
        assert r["skipped"] == [False] * 10 and r["steps_taken"] == 10
        assert r["reloaded_diff"] == 0.0, f"rank {rank}: a reloaded checkpoint differs by {r['reloaded_diff']}"
