"""Runs examples/02_dp_x_tp_gpt with context parallelism (--cp) under torchrun and checks every loss
curve matches the one-process run (whole sequences, same seed and global batch): dp 2 x cp 2; cp 2 x
tp 2 with sequence parallelism; dp 2 x cp 2 with the ZeRO-1 optimizer, with AdamW and with SGD (whose
update shows a wrong gradient scale that AdamW's would hide). Tolerance: rtol 1e-5 over 10 steps, as
check_gpt_example.py -- the runs differ only in how fp32 sums are split (attention over gathered keys,
DP x CP means, TP partial sums), ~1e-7 per step; measured max relative differences are printed below.
Gradients reduced over DP only (not DP x CP) leave CP ranks with different params and move the
second step's loss by far more."""
import sys

from torchrun_losses import run_losses

binary = sys.argv[1]
STEPS = 10
RTOL = 1e-5


def losses(dp, cp, tp, *extra):
    return run_losses(binary, dp * cp * tp, STEPS, ["--dp", str(dp), "--cp", str(cp), "--tp", str(tp),
                                                    "--global-batch", "16", "--seed", "1", *extra])


def check(name, reference, curve):
    print(f"{name:26s}:", curve)
    worst = max(abs(a - b) / abs(a) for a, b in zip(reference, curve))
    print(f"{'':26s}  max relative difference to 1x1x1: {worst:.2e}")
    for s, (a, b) in enumerate(zip(reference, curve)):
        if abs(a - b) > RTOL * abs(a):
            sys.exit(f"FAILED: step {s}: loss {a} at 1x1x1 vs {b} at {name} (rtol {RTOL})")


reference = losses(1, 1, 1)
print(f"{'1x1x1':26s}:", reference)
if not reference[-1] < reference[0]:
    sys.exit(f"FAILED: the loss did not decrease: {reference[0]} -> {reference[-1]}")
check("dp2 x cp2", reference, losses(2, 2, 1))
check("cp2 x tp2 sequence-parallel", reference, losses(1, 2, 2, "--sequence-parallel"))
check("dp2 x cp2 ZeRO-1", reference, losses(2, 2, 1, "--distributed-optimizer"))
sgd = ("--optimizer", "sgd", "--lr", "0.5")
sgd_reference = losses(1, 1, 1, *sgd)
print(f"{'1x1x1 SGD':26s}:", sgd_reference)
if not sgd_reference[-1] < sgd_reference[0]:
    sys.exit(f"FAILED: the SGD loss did not decrease: {sgd_reference[0]} -> {sgd_reference[-1]}")
check("dp2 x cp2 ZeRO-1 SGD", sgd_reference, losses(2, 2, 1, "--distributed-optimizer", *sgd))
print("1 passed, 0 failed")
