"""Runs examples/02_dp_x_tp_gpt under torchrun at DP x TP = 1x1, 2x2, 1x4, 4x1, 2x2 with sequence
parallelism and 2x2 with the ZeRO-1 optimizer, same seed and global batch, and checks every loss
curve matches the 1x1 run. Tolerance: rtol 1e-5 over 10 steps -- the runs differ only in how fp32
sums are split (TP partial sums, the vocab-parallel softmax, DP means), ~1e-7 per step, which AdamW
carries forward: measured max relative difference 3.5e-7 (printed below); a dropped or doubled 1/DP
or TP sum moves the second step's loss by > 1e-3. ZeRO-1 is also checked with SGD, whose update shows a
wrong gradient scale that AdamW's would hide."""
import sys

from torchrun_losses import expect_curve_close, expect_decreasing, run_losses

binary = sys.argv[1]
STEPS = 10
RTOL = 1e-5


def losses(dp, tp, *extra):
    return run_losses(binary, dp * tp, STEPS, ["--dp", str(dp), "--tp", str(tp), "--global-batch", "16", "--seed", "1", *extra])


reference = losses(1, 1)
print("1x1         :", reference)
for dp, tp, extra in ((2, 2, ()), (1, 4, ()), (4, 1, ()), (2, 2, ("--sequence-parallel",)),
                      (2, 2, ("--distributed-optimizer",))):
    expect_curve_close(reference, losses(dp, tp, *extra), RTOL, f"{dp}x{tp} {' '.join(extra)}".strip())
sgd_reference = losses(1, 1, "--optimizer", "sgd", "--lr", "0.5")
print("1x1 SGD     :", sgd_reference)
expect_curve_close(sgd_reference, losses(2, 2, "--distributed-optimizer", "--optimizer", "sgd", "--lr", "0.5"), RTOL,
                   "2x2 ZeRO-1 SGD", "1x1 SGD")
expect_decreasing(sgd_reference, "the SGD loss")
expect_decreasing(reference)
print("1 passed, 0 failed")
