"""Checkpoints of examples/02_dp_x_tp_gpt on a pipeline: a pp 2 run (1F1B, 4 micro-batches) saves at
step 3; resumed at pp 2 it repeats steps 3..5 bit for bit; resumed at pp 1 (one chunk holding every
layer, the LM head tied to the embedding in one tensor) and at pp 4 (one layer per stage) it follows
the one-process curve. Params are saved and found by their global names (blocks.3.* on whichever
stage holds layer 3, wte.weight and lm_head.weight for the tied embedding's two copies), so the
resharding across pipeline sizes is the name matching the TP resharding already does.
Tolerance: rtol 1e-5 against the one-process curve, as check_gpt_pipeline.py."""
import os
import sys
import tempfile

from torchrun_losses import expect_curve_close, run_losses

binary = sys.argv[1]
STEPS = 6
RTOL = 1e-5
MODEL = ["--layers", "4", "--global-batch", "16", "--seed", "1"]

reference = run_losses(binary, 1, STEPS, [*MODEL, "--dp", "1", "--tp", "1"])
print(f"{'one process':26s}:", reference)
with tempfile.TemporaryDirectory() as tmp:
    save = ["--save-dir", os.path.join(tmp, "ckpt"), "--save-every", "3"]
    saved = run_losses(binary, 2, STEPS, [*MODEL, "--pp", "2", "--microbatches", "4", *save])
    expect_curve_close(reference, saved, RTOL, "pp2 (saves step 3)", "one process")
    for name, nproc, args in (("pp2", 2, ["--pp", "2"]), ("pp1", 1, ["--pp", "1"]), ("pp4", 4, ["--pp", "4"])):
        resumed = run_losses(binary, nproc, STEPS, [*MODEL, *args, "--microbatches", "4", *save, "--resume-step", "3"],
                             first=3)
        if name == "pp2" and resumed != saved[3:]:
            sys.exit(f"FAILED: resuming the pp2 run at pp2 from step 3 gave {resumed}, not {saved[3:]}")
        expect_curve_close(reference[3:], resumed, RTOL, f"resumed at {name}", "one process", first=3)
print("1 passed, 0 failed")
