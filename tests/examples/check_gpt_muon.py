"""Runs examples/02_dp_x_tp_gpt with --optimizer muon (Muon on the block matrices, AdamW on the
embeddings, the tied head and the vectors; whole-param ZeRO-1 shards) under torchrun and checks that
the loss curves at dp 2, dp 4 and dp 2 x tp 2 (the column- and row-parallel matrices gathered whole
over TP for Newton-Schulz) match the one-process run (same seed and global batch) and decrease.
Tolerance RTOL below: the runs differ in how fp32 sums are split (~1e-7), which the bf16 Newton-Schulz
iteration can round into one bf16 ulp of an update (2^-8 relative). Measured over 8 steps: max
relative differences 1.84e-5 (dp 2), 8.74e-6 (dp 4), 3.96e-5 (dp 2 x tp 2), 1.90e-5 (pp 2, 4 micro-batches:
a DistributedOptimizer with Muon per chunk). Seen failing with the TP pieces of a row-parallel matrix
assembled in the wrong order (dp 2 x tp 2 at 1.05e-2), and with the last stage's lm_head.weight left on
Muon while its tied copy wte.weight steps on AdamW (pp 2: the example's check_tied_params_identical fails
after step 1, the copies 1.4e-2 apart)."""
import sys

from torchrun_losses import expect_curve_close, expect_decreasing, run_losses

binary = sys.argv[1]
STEPS = 8
RTOL = 2e-4


def losses(dp, tp=1, *extra, pp=1):
    return run_losses(binary, dp * tp * pp, STEPS,
                      ["--dp", str(dp), "--tp", str(tp), "--global-batch", "16", "--seed", "1",
                       "--distributed-optimizer", "--optimizer", "muon", "--lr", "0.01", *extra])


reference = losses(1)
print(f"{'one process muon':20s}:", reference)
expect_decreasing(reference)
for dp, tp in ((2, 1), (4, 1), (2, 2)):
    name = f"dp{dp} muon" if tp == 1 else f"dp{dp} x tp{tp} muon"
    expect_curve_close(reference, losses(dp, tp), RTOL, name, reference_name="one process")
# A pipeline: a DistributedOptimizer with Muon per chunk (each stage's blocks), the tied embedding's
# two copies on AdamW.
expect_curve_close(reference, losses(1, 1, "--pp", "2", "--micro-batches", "4", pp=2), RTOL, "pp2 muon",
                   reference_name="one process")
print("1 passed, 0 failed")
