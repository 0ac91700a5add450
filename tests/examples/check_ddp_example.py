"""Runs examples/01_ddp under torchrun at 1 and 2 ranks (and 2 ranks with the ZeRO-1 distributed
optimizer) with the same seed and global batch and checks that the per-step global-batch losses agree. Tolerance: rtol 1e-5 -- the losses differ
only by the order fp32 sums are taken in (per-rank partial sums, then the DP mean), a few ulps per
step that AdamW carries forward over 8 steps."""
import os
import re
import subprocess
import sys

binary = sys.argv[1]
torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
STEPS = 8


def losses(nproc, *extra):
    cmd = [torchrun, "--standalone", f"--nproc-per-node={nproc}", "--no-python", binary,
           "--steps", str(STEPS), "--global-batch", "32", "--seed", "3", "--hidden", "64", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if out.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)} exited {out.returncode}\n{out.stdout}\n{out.stderr}")
    found = re.findall(r"^step (\d+) loss (\S+)$", out.stdout, re.M)
    if [int(s) for s, _ in found] != list(range(STEPS)):
        sys.exit(f"FAILED: expected 'step 0..{STEPS - 1} loss X' from {nproc} rank(s), got:\n{out.stdout}\n{out.stderr}")
    for _, text in found:
        mantissa = text.lstrip("-").split("e")[0].replace(".", "").lstrip("0")
        if len(mantissa) < 8:
            sys.exit(f"FAILED: loss '{text}' has fewer than 8 significant digits")
    return [float(v) for _, v in found]


one, two = losses(1), losses(2)
zero = losses(2, "--distributed-optimizer")
print("1 rank          :", one)
print("2 ranks         :", two)
print("2 ranks, ZeRO-1 :", zero)
for name, other in (("2 ranks", two), ("2 ranks with --distributed-optimizer", zero)):
    for s, (a, b) in enumerate(zip(one, other)):
        if abs(a - b) > 1e-5 * abs(a):
            sys.exit(f"FAILED: step {s}: loss {a} at 1 rank vs {b} at {name} (rtol 1e-5)")
if not two[-1] < two[0]:
    sys.exit(f"FAILED: loss did not decrease: {two[0]} -> {two[-1]}")
print("1 passed, 0 failed")
