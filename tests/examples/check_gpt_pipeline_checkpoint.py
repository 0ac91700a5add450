"""Checkpoints of examples/02_dp_x_tp_gpt on a pipeline: a pp 2 run (1F1B, 4 micro-batches) saves at
step 2 of 4; resumed at pp 1 (one chunk holding every layer, the LM head tied to the embedding in one
tensor) and at pp 4 (one layer per stage) it continues the one-process curve. Params are saved and
found by their global names (blocks.3.* on whichever stage holds layer 3; wte.weight and
lm_head.weight, the tied embedding's two copies), so the resharding across pipeline sizes is the name
matching the TP resharding already does; the manifest records pp_size. ~30 s on 2 loaded cores.
Tolerance: rtol 1e-6 against the one-process curve, as check_gpt_pipeline.py."""
import os
import sys
import tempfile

from torchrun_losses import expect_curve_close, run_losses

binary = sys.argv[1]
STEPS = 4
RTOL = 1e-6
MODEL = ["--layers", "4", "--global-batch", "16", "--seed", "1", "--optimizer", "sgd", "--lr", "2",
         "--micro-batches", "4"]

reference = run_losses(binary, 1, STEPS, [*MODEL, "--dp", "1", "--tp", "1"])
print(f"{'one process':26s}:", reference)
with tempfile.TemporaryDirectory() as tmp:
    save = ["--save-dir", os.path.join(tmp, "ckpt"), "--save-every", "2"]
    saved = run_losses(binary, 2, STEPS, [*MODEL, "--pp", "2", *save])
    expect_curve_close(reference, saved, RTOL, "pp2 (saves step 2)", "one process")
    for name, nproc in (("pp1", 1), ("pp4", 4)):
        resumed = run_losses(binary, nproc, STEPS, [*MODEL, "--pp", name[2:], *save, "--resume-step", "2"], first=2)
        expect_curve_close(reference[2:], resumed, RTOL, f"resumed at {name}", "one process", first=2)
print("1 passed, 0 failed")
