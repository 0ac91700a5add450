"""Runs examples/02_dp_x_tp_gpt on a pipeline (--pp, --vpp, --micro-batches) under torchrun and checks
its loss curve, and its final params, against one process on the whole global batch (the example's
plain path, --dp 1 --tp 1: no pipeline code at all), same seed and global batch. One case per call
(ctest runs each as its own test, ~10-30 s on 2 loaded cores):

  pp2                 1F1B, 4 micro-batches
  dp2_pp2_zero1       dp 2 x pp 2, --distributed-optimizer (one DistributedOptimizer per chunk)
  pp2_vpp2            the interleaved schedule, 2 chunks per rank
  pp2_per_token       --loss per-token (sequences of random length; the loss summed over valid tokens,
                      finalize_model_grads divides by the global count)
  dp2_pp2_tp2_vpp2    8 ranks: dp 2 x pp 2 x tp 2, vpp 2, sequence parallel, ZeRO-1
  pp2_cp2             pp 2 x cp 2
  pp2_vpp2_clip       --clip-grad 0.3 (below every step's norm: each step clipped) on the interleaved
                      schedule: one norm over both stages' chunks, the tied embedding counted once
  dp2_pp2_tp2_vpp2_zero1_clip  the same with ZeRO-1 (DistributedOptimizer::step_together over the
                      rank's chunks), TP 2 with sequence parallel
  pp2_vpp2_zero1_nan0, pp2_vpp2_zero1_nan1
                      ZeRO-1 with a NaN gradient injected at step 2 on the first (rank 0) or the last
                      stage (rank 1): every stage skips step 2, as one process (also ZeRO-1, its NaN
                      at step 2) does; the curves then agree only if no stage stepped

Every case also compares the step log's gradient norm (--log-interval 1, printed to 4 decimals) with
one process's, within 1.5e-4 (the rounding): a pipeline's norm is the whole model's.

SGD (lr 2): a gradient off by a scale or a missing term shows in the curve (AdamW would hide a scale).
The example checks after every step that the tied embedding's two copies (wte.weight on the first
stage, lm_head.weight on the last) are bit-identical (check_tied_params_identical) and fails the run
if not; here the final checkpoint's two copies are compared bit for bit too.

Tolerances: rtol 1e-6 for the losses over 4 steps and atol 1e-6 for the final params: the runs differ
from the one process only in how fp32 sums are split (micro-batch gradients accumulated in the flat
buffer, DP means, TP partial sums). Measured: see the numbers printed (docs/guide/pipelines.md records them)."""
import math
import os
import sys
import tempfile

import torch

from torchrun_losses import expect_curve_close, expect_decreasing, logged_grad_norms, run_losses

from meshddp import consolidate  # noqa: E402  (the engine's checkpoint reader; needs only its _C)

binary, case = sys.argv[1], sys.argv[2]
STEPS = 4
RTOL = 1e-6
PARAM_ATOL = 1e-6
MODEL = ["--layers", "4", "--global-batch", "16", "--seed", "1", "--optimizer", "sgd", "--lr", "2"]
PER_TOKEN = ["--loss", "per-token"]
CASES = {
    "pp2": (2, ["--pp", "2", "--micro-batches", "4"]),
    "dp2_pp2_zero1": (4, ["--dp", "2", "--pp", "2", "--micro-batches", "2", "--distributed-optimizer"]),
    "pp2_vpp2": (2, ["--pp", "2", "--vpp", "2", "--micro-batches", "4"]),
    "pp2_per_token": (2, ["--pp", "2", "--micro-batches", "4", *PER_TOKEN]),
    "dp2_pp2_tp2_vpp2": (8, ["--dp", "2", "--pp", "2", "--tp", "2", "--vpp", "2", "--micro-batches", "2",
                             "--sequence-parallel", "--distributed-optimizer"]),
    "pp2_cp2": (4, ["--pp", "2", "--cp", "2", "--micro-batches", "2"]),
    "pp4": (4, ["--pp", "4", "--micro-batches", "4"]),  # middle stages: no embedding, no head
    "pp2_vpp2_clip": (2, ["--pp", "2", "--vpp", "2", "--micro-batches", "4", "--clip-grad", "0.3"]),
    "dp2_pp2_tp2_vpp2_zero1_clip": (8, ["--dp", "2", "--pp", "2", "--tp", "2", "--vpp", "2", "--micro-batches", "2",
                                        "--sequence-parallel", "--distributed-optimizer", "--clip-grad", "0.3"]),
    "pp2_vpp2_zero1_nan0": (2, ["--pp", "2", "--vpp", "2", "--micro-batches", "4", "--distributed-optimizer",
                                "--inject-nan", "2:0"]),
    "pp2_vpp2_zero1_nan1": (2, ["--pp", "2", "--vpp", "2", "--micro-batches", "4", "--distributed-optimizer",
                                "--inject-nan", "2:1"]),
}
NAN_STEP = 2
if case not in CASES:
    sys.exit(f"FAILED: unknown case '{case}'; one of {', '.join(CASES)}")
nproc, args = CASES[case]


def run(nproc, args, save_dir):
    return run_losses(binary, nproc, STEPS, [*MODEL, *args, "--log-interval", "1", "--save-dir", save_dir],
                      with_stderr=True)


def reference_args(args):
    """One process, with the case's loss and clipping; for a NaN case, ZeRO-1 with its NaN at the same step."""
    out = ["--dp", "1", "--tp", "1"]
    for flag in ("--loss", "--clip-grad"):
        if flag in args:
            out += args[args.index(flag):args.index(flag) + 2]
    if "--inject-nan" in args:
        out += ["--distributed-optimizer", "--inject-nan", f"{NAN_STEP}:0"]
    return out


def expect_norms_close(reference, got):
    if len(reference) != STEPS or len(got) != STEPS:
        sys.exit(f"FAILED: {case}: expected {STEPS} logged grad norms, got {reference} and {got}")
    print(f"{'':26s}  grad norms: one process {reference}, {case} {got}")
    for s, (a, b) in enumerate(zip(reference, got)):
        if (math.isnan(a) or math.isnan(b)) and not (math.isnan(a) and math.isnan(b)) or abs(a - b) > 1.5e-4:
            sys.exit(f"FAILED: {case}: step {s}: grad norm {b} on the pipeline vs {a} in one process (within 1.5e-4)")


with tempfile.TemporaryDirectory() as tmp:
    ref_dir, case_dir = os.path.join(tmp, "reference"), os.path.join(tmp, case)
    reference, reference_err = run(1, reference_args(args), ref_dir)
    print(f"{'one process':26s}:", reference)
    if "--inject-nan" not in args:  # a skipped step of 4 leaves too few to learn in
        expect_decreasing(reference)
    curve, err = run(nproc, args, case_dir)
    expect_curve_close(reference, curve, RTOL, case, "one process")
    expect_norms_close(logged_grad_norms(reference_err), logged_grad_norms(err))
    if "--inject-nan" in args and f"step {NAN_STEP} skipped" not in err:
        sys.exit(f"FAILED: {case}: no 'step {NAN_STEP} skipped' report in the pipeline run's stderr:\n{err}")
    want, _ = consolidate.consolidate(ref_dir, STEPS)
    got, _ = consolidate.consolidate(case_dir, STEPS)
    worst = 0.0
    for key, ref in want.items():
        if key not in got:
            sys.exit(f"FAILED: {case}: the final checkpoint has no '{key}'")
        worst = max(worst, (got[key] - ref).abs().max().item())
    print(f"{'':26s}  final params: max abs difference to one process {worst:.2e}")
    if worst > PARAM_ATOL:
        sys.exit(f"FAILED: {case}: final params differ from one process's by {worst} (atol {PARAM_ATOL})")
    if not torch.equal(got["lm_head.weight"], got["wte.weight"]):
        diff = (got["lm_head.weight"] - got["wte.weight"]).abs().max().item()
        sys.exit(f"FAILED: {case}: the tied copies lm_head.weight and wte.weight differ (by up to {diff})")
print("1 passed, 0 failed")
