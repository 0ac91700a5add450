"""Runs examples/02_dp_x_tp_gpt on a pipeline (--pp, --vpp, --microbatches) under torchrun and checks
every loss curve, and the final params, against one process on the whole global batch (the example's
plain path, --dp 1 --tp 1: no pipeline code at all), same seed and global batch:
pp 2 and pp 4 (1F1B); dp 2 x pp 2; pp 2 with vpp 2 (interleaved); pp 2 x cp 2; dp 2 x pp 2 x tp 2 with
vpp 2, sequence parallelism and ZeRO-1 (8 ranks); and with the per-token loss (sequences of random
length, the loss summed over valid tokens over the global count) pp 2 and dp 2 x pp 2 with vpp 2.
The example itself checks after every step that the tied embedding's two copies (wte.weight on the
first stage, lm_head.weight on the last) are bit-identical, and fails the run if not; here the final
checkpoint's two copies are compared too.

Tolerance: rtol 1e-5 for the losses over 6 steps, as check_gpt_example.py: the runs differ from the
one process only in how fp32 sums are split (micro-batch gradients accumulated in the flat buffer, DP
means, TP partial sums); final params atol 1e-5 (AdamW with lr 1e-2 moves them ~6e-2 in 6 steps).
Measured: see the numbers printed below (docs/pipeline.md records them)."""
import os
import sys
import tempfile

import torch

from torchrun_losses import expect_curve_close, expect_decreasing, run_losses

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import consolidate_checkpoint  # noqa: E402

binary = sys.argv[1]
STEPS = 6
RTOL = 1e-5
PARAM_ATOL = 1e-5
MODEL = ["--layers", "4", "--global-batch", "16", "--seed", "1"]


def run(nproc, args, save_dir=None):
    extra = ["--save-dir", save_dir] if save_dir else []
    return run_losses(binary, nproc, STEPS, [*MODEL, *args, *extra])


def final_params(save_dir):
    """The model's params after the last step, whole (name -> tensor), from the run's checkpoint."""
    return consolidate_checkpoint.consolidate(save_dir, STEPS)


def check_params(name, reference, params):
    """Every param of the one-process model within PARAM_ATOL; the tied copies bit-identical."""
    worst = 0.0
    for key, ref in reference.items():
        if key not in params:
            sys.exit(f"FAILED: {name}: the final checkpoint has no '{key}'")
        worst = max(worst, (params[key] - ref).abs().max().item())
    print(f"{'':26s}  final params: max abs difference to one process {worst:.2e}")
    if worst > PARAM_ATOL:
        sys.exit(f"FAILED: {name}: final params differ from one process's by {worst} (atol {PARAM_ATOL})")
    if "lm_head.weight" in params and not torch.equal(params["lm_head.weight"], params["wte.weight"]):
        sys.exit(f"FAILED: {name}: the tied copies lm_head.weight and wte.weight differ in the final checkpoint")


with tempfile.TemporaryDirectory() as tmp:
    reference = run(1, ["--dp", "1", "--tp", "1"], os.path.join(tmp, "reference"))
    print(f"{'one process':26s}:", reference)
    expect_decreasing(reference)
    reference_params = final_params(os.path.join(tmp, "reference"))
    cases = [
        ("pp2 1F1B", 2, ["--pp", "2", "--microbatches", "4"], True),
        ("pp4 1F1B", 4, ["--pp", "4", "--microbatches", "4"], False),
        ("dp2 x pp2", 4, ["--dp", "2", "--pp", "2", "--microbatches", "2"], False),
        ("pp2 vpp2 interleaved", 2, ["--pp", "2", "--vpp", "2", "--microbatches", "4"], True),
        ("pp2 x cp2", 4, ["--pp", "2", "--cp", "2", "--microbatches", "2"], False),
        ("dp2xpp2xtp2 vpp2 SP ZeRO-1", 8, ["--dp", "2", "--pp", "2", "--tp", "2", "--vpp", "2", "--microbatches", "2",
                                           "--sequence-parallel", "--distributed-optimizer"], True),
    ]
    for name, nproc, args, with_params in cases:
        save = os.path.join(tmp, name.replace(" ", "_")) if with_params else None
        expect_curve_close(reference, run(nproc, args, save), RTOL, name, "one process")
        if with_params:
            check_params(name, reference_params, final_params(save))

per_token = ["--loss", "per-token"]
token_reference = run(1, ["--dp", "1", "--tp", "1", *per_token])
print(f"{'one process per-token':26s}:", token_reference)
for name, nproc, args in (("pp2 per-token", 2, ["--pp", "2", "--microbatches", "4"]),
                          ("dp2 x pp2 vpp2 per-token", 4, ["--dp", "2", "--pp", "2", "--vpp", "2",
                                                           "--microbatches", "2"])):
    expect_curve_close(token_reference, run(nproc, [*args, *per_token]), RTOL, name, "one process per-token")
print("1 passed, 0 failed")
