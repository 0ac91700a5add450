"""Runs examples/02_dp_x_tp_gpt with hierarchical ZeRO-1 (--distributed-optimizer --optimizer-instances
K) under torchrun and checks every loss curve matches the one-process run (same seed and global
batch): dp 4 in 2 instances with AdamW and with SGD (whose update shows a wrong gradient scale that
AdamW's would hide), and dp 2 x cp 2 in 2 instances (the flattened DP x CP group cut in two) with SGD.
Tolerance: rtol 1e-5 over 10 steps, as check_gpt_example.py -- the runs differ only in how fp32 sums
are split (per-rank partial sums, a reduce-scatter within the instance then an all-reduce across),
~1e-7 per step: measured max relative differences 1.55e-7 (AdamW), 1.72e-7 (SGD), 2.30e-7 (dp2 x cp2
SGD), printed below. Broken on purpose (the all-reduce across instances skipped in bucket_sync.cpp):
each instance steps on its half of the batch, and step 1's loss moves by 1.3e-3 relative (4.5e-2 by
step 9): the check fails at step 1."""
import sys

from torchrun_losses import expect_curve_close, expect_decreasing, run_losses

binary = sys.argv[1]
STEPS = 10
RTOL = 1e-5


def losses(dp, cp, *extra):
    mesh = ["--dp", str(dp), "--tp", "1"] + (["--cp", str(cp)] if cp > 1 else [])
    return run_losses(binary, dp * cp, STEPS, [*mesh, "--global-batch", "16", "--seed", "1", *extra])


def check(name, reference, curve):
    expect_curve_close(reference, curve, RTOL, name, reference_name="one process")


hier = ("--distributed-optimizer", "--optimizer-instances", "2")
sgd = ("--optimizer", "sgd", "--lr", "0.5")
reference = losses(1, 1)
print(f"{'one process':30s}:", reference)
expect_decreasing(reference)
check("dp4 ZeRO-1 in 2 instances", reference, losses(4, 1, *hier))
sgd_reference = losses(1, 1, *sgd)
print(f"{'one process SGD':30s}:", sgd_reference)
check("dp4 ZeRO-1 in 2 instances SGD", sgd_reference, losses(4, 1, *hier, *sgd))
check("dp2 x cp2 ZeRO-1 2 inst. SGD", sgd_reference, losses(2, 2, *hier, *sgd))
print("1 passed, 0 failed")
