"""A checkpoint of examples/02_dp_x_tp_gpt resumed by the other trainer or in the other dtype is refused
with the flags that resume it. The tensors a checkpoint holds follow two flags: --pp/--vpp (the
pipeline trainer keeps the tied LM head's last-stage copy as its own lm_head.weight; the plain trainer
has wte.weight alone) and --dtype (bf16 or fp32 params). The load names the tensors that differ; the
example adds which checkpoints this run resumes and the flags for the others
(gpt_flags.h resume_hint). Cases: a bf16 pp 2 ZeRO-1 checkpoint resumed without --pp and with
--dtype fp32; a plain bf16 checkpoint resumed with --pp 2. Each refusal exits 1 having loaded nothing.
~15 s on 2 loaded cores. Usage: check_gpt_resume_hints.py <gpt_example>."""
import os
import subprocess
import sys
import tempfile

from torchrun_losses import run_losses

binary = sys.argv[1]
torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
MODEL = ["--layers", "4", "--global-batch", "8", "--micro-batches", "2", "--distributed-optimizer"]
failures = []


def refused(name, nproc, args, *texts):
    cmd = [torchrun, "--standalone", f"--nproc-per-node={nproc}", "--no-python", binary, "--steps", "2", *MODEL, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    missing = [t for t in ("nothing was loaded", *texts) if t not in out.stderr]
    if out.returncode == 0 or missing:
        failures.append(f"{name}: exit {out.returncode}, missing {missing} in:\n{out.stderr[-3000:]}")
    print(f"{name}: {'refused by name' if out.returncode and not missing else 'FAILED'}")


with tempfile.TemporaryDirectory() as tmp:
    pipeline, plain = os.path.join(tmp, "pipeline"), os.path.join(tmp, "plain")
    run_losses(binary, 2, 1, [*MODEL, "--pp", "2", "--dtype", "bf16", "--save-dir", pipeline])
    run_losses(binary, 1, 1, [*MODEL, "--dtype", "bf16", "--save-dir", plain])
    refused("a pipeline checkpoint resumed without --pp", 1,
            ["--dtype", "bf16", "--save-dir", pipeline, "--resume"],
            "'model/lm_head.weight'", "one saved with --pp/--vpp", "resumes only with --pp")
    refused("a bf16 pipeline checkpoint resumed in fp32", 2,
            ["--pp", "2", "--dtype", "fp32", "--save-dir", pipeline, "--resume"],
            "is BF16 in the checkpoint but F32 here", "one saved with --dtype bf16 only with --dtype bf16")
    refused("a plain checkpoint resumed with --pp", 2,
            ["--pp", "2", "--dtype", "bf16", "--save-dir", plain, "--resume"],
            "the checkpoint has no 'model/lm_head.weight'", "one saved without --pp/--vpp",
            "resumes only without them")
if failures:
    sys.exit("FAILED:\n" + "\n".join(failures))
print("3 passed, 0 failed")
