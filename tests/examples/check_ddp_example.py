"""Runs examples/01_ddp under torchrun at 1 and 2 ranks (and 2 ranks with the ZeRO-1 distributed
optimizer) with the same seed and global batch and checks that the per-step global-batch losses agree. Tolerance: rtol 1e-5 -- the losses differ
only by the order fp32 sums are taken in (per-rank partial sums, then the DP mean), a few ulps per
step that AdamW carries forward over 8 steps. Also: 4 steps at 2 ranks with --save-dir, then --resume at
1 rank up to step 8 continues the 1-rank curve (same tolerance)."""
import os
import shutil
import sys
import tempfile

from torchrun_losses import expect_curve_close, expect_decreasing, run_losses

binary = sys.argv[1]
STEPS = 8


def losses(nproc, *extra):
    return run_losses(binary, nproc, STEPS, ["--global-batch", "32", "--seed", "3", "--hidden", "64", *extra])


one, two = losses(1), losses(2)
zero = losses(2, "--distributed-optimizer")
print("1 rank          :", one)
for name, other in (("2 ranks", two), ("2 ranks with --distributed-optimizer", zero)):
    expect_curve_close(one, other, 1e-5, name, "1 rank")
save_dir = tempfile.mkdtemp(prefix="meshddp-ddp-ckpt-")
try:
    common = ["--global-batch", "32", "--seed", "3", "--hidden", "64", "--save-dir", os.path.join(save_dir, "c")]
    run_losses(binary, 2, 4, common)
    resumed = run_losses(binary, 1, STEPS, [*common, "--resume"], first=4)
finally:
    shutil.rmtree(save_dir, ignore_errors=True)
expect_curve_close(one[4:], resumed, 1e-5, "resumed at step 4 on 1 rank from a 2-rank checkpoint", "1 rank", first=4)
expect_decreasing(two)
print("1 passed, 0 failed")
