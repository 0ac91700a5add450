"""Runs examples/01_ddp under torchrun at 1 and 2 ranks (and 2 ranks with the ZeRO-1 distributed
optimizer) with the same seed and global batch and checks that the per-step global-batch losses agree. Tolerance: rtol 1e-5 -- the losses differ
only by the order fp32 sums are taken in (per-rank partial sums, then the DP mean), a few ulps per
step that AdamW carries forward over 8 steps. Also: 4 steps at 2 ranks with --save-dir, then --resume at
1 rank up to step 8 continues the 1-rank curve (same tolerance)."""
import os
import shutil
import sys
import tempfile

from torchrun_losses import run_losses

binary = sys.argv[1]
STEPS = 8


def losses(nproc, *extra):
    return run_losses(binary, nproc, STEPS, ["--global-batch", "32", "--seed", "3", "--hidden", "64", *extra])


one, two = losses(1), losses(2)
zero = losses(2, "--distributed-optimizer")
print("1 rank          :", one)
print("2 ranks         :", two)
print("2 ranks, ZeRO-1 :", zero)
for name, other in (("2 ranks", two), ("2 ranks with --distributed-optimizer", zero)):
    for s, (a, b) in enumerate(zip(one, other)):
        if abs(a - b) > 1e-5 * abs(a):
            sys.exit(f"FAILED: step {s}: loss {a} at 1 rank vs {b} at {name} (rtol 1e-5)")
save_dir = tempfile.mkdtemp(prefix="meshddp-ddp-ckpt-")
try:
    common = ["--global-batch", "32", "--seed", "3", "--hidden", "64", "--save-dir", os.path.join(save_dir, "c")]
    run_losses(binary, 2, 4, common)
    resumed = run_losses(binary, 1, STEPS, [*common, "--resume"], first=4)
finally:
    shutil.rmtree(save_dir, ignore_errors=True)
print("resumed at step 4 on 1 rank from a 2-rank checkpoint:", resumed)
for s, (a, b) in enumerate(zip(one[4:], resumed)):
    if abs(a - b) > 1e-5 * abs(a):
        sys.exit(f"FAILED: step {4 + s}: loss {a} at 1 rank vs {b} resumed (rtol 1e-5)")
if not two[-1] < two[0]:
    sys.exit(f"FAILED: loss did not decrease: {two[0]} -> {two[-1]}")
print("1 passed, 0 failed")
