"""Runs examples/02_dp_x_tp_gpt with context parallelism (--cp) under torchrun and checks every loss
curve matches the one-process run (whole sequences, same seed and global batch): dp 2 x cp 2; cp 2 x
tp 2 with sequence parallelism; dp 2 x cp 2 with the ZeRO-1 optimizer, with AdamW and with SGD (whose
update shows a wrong gradient scale that AdamW's would hide). Tolerance: rtol 1e-5 over 10 steps, as
check_gpt_example.py -- the runs differ only in how fp32 sums are split (attention over gathered keys,
DP x CP means, TP partial sums), ~1e-7 per step: measured max relative differences 1.7e-7 (dp2 x cp2),
2.1e-7 (cp2 x tp2 SP), 1.7e-7 (ZeRO-1), 2.0e-7 (ZeRO-1 SGD), printed below. Broken on purpose:
gradients averaged over DP only (not DP x CP, replica check off) move step 1's loss by 1.7e-4 relative
(3.8e-2 by step 9); a causal mask without the slice offset moves step 0's by 8.9e-4. The ZeRO-1 run
also saves a checkpoint at step 5; resuming it at dp2 x cp2 must give the same steps 5..9 bit for bit."""
import sys
import tempfile

from torchrun_losses import expect_curve_close, expect_decreasing, run_losses

binary = sys.argv[1]
STEPS = 10
RTOL = 1e-5


def losses(dp, cp, tp, *extra):
    return run_losses(binary, dp * cp * tp, STEPS, ["--dp", str(dp), "--cp", str(cp), "--tp", str(tp),
                                                    "--global-batch", "16", "--seed", "1", *extra])


def check(name, reference, curve):
    expect_curve_close(reference, curve, RTOL, name, "1x1x1")


reference = losses(1, 1, 1)
print(f"{'1x1x1':26s}:", reference)
expect_decreasing(reference)
check("dp2 x cp2", reference, losses(2, 2, 1))
check("cp2 x tp2 sequence-parallel", reference, losses(1, 2, 2, "--sequence-parallel"))
with tempfile.TemporaryDirectory() as checkpoints:
    saved = ("--distributed-optimizer", "--save-dir", checkpoints, "--save-every", "5")
    zero1 = losses(2, 2, 1, *saved)
    check("dp2 x cp2 ZeRO-1", reference, zero1)
    resumed = run_losses(binary, 4, STEPS, ["--dp", "2", "--cp", "2", "--tp", "1", "--global-batch", "16", "--seed", "1",
                                            *saved, "--resume-step", "5"], first=5)
    print(f"{'dp2 x cp2 ZeRO-1 resumed@5':26s}:", resumed)
    if resumed != zero1[5:]:
        sys.exit(f"FAILED: resuming the dp2 x cp2 ZeRO-1 run at step 5 gave {resumed}, not {zero1[5:]}")
sgd = ("--optimizer", "sgd", "--lr", "0.5")
sgd_reference = losses(1, 1, 1, *sgd)
print(f"{'1x1x1 SGD':26s}:", sgd_reference)
expect_decreasing(sgd_reference, "the SGD loss")
check("dp2 x cp2 ZeRO-1 SGD", sgd_reference, losses(2, 2, 1, "--distributed-optimizer", *sgd))
print("1 passed, 0 failed")
