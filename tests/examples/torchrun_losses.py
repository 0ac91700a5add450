"""Shared by the example checks: run an example binary under torchrun and return the `step <n> loss <x>`
curve it prints, failing (exit) on a non-zero exit, missing steps, or fewer than 8 significant digits."""
import os
import re
import subprocess
import sys


def run_losses(binary, nproc, steps, args, first=0, env=None, expect_in_stderr=(), with_stderr=False):
    """`binary`: an executable, or a .py script (run by torchrun's Python). Steps first..steps-1 are
    expected (first > 0: a run resumed from a checkpoint). Each text of `expect_in_stderr` must
    appear in the run's stderr (e.g. the step log's header). with_stderr: returns (losses, stderr)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    launch = [binary] if binary.endswith(".py") else ["--no-python", binary]
    cmd = [torchrun, "--standalone", f"--nproc-per-node={nproc}", *launch, "--steps", str(steps), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    if out.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)} exited {out.returncode}\n{out.stdout}\n{out.stderr}")
    for text in expect_in_stderr:
        if text not in out.stderr:
            sys.exit(f"FAILED: '{text}' is not in the stderr of {' '.join(cmd)}:\n{out.stderr}")
    found = re.findall(r"^step (\d+) loss (\S+)$", out.stdout, re.M)
    if [int(s) for s, _ in found] != list(range(first, steps)):
        sys.exit(f"FAILED: expected 'step {first}..{steps - 1} loss X' from {' '.join(cmd)}, got:\n{out.stdout}\n{out.stderr}")
    for _, text in found:
        if len(text.lstrip("-").split("e")[0].replace(".", "").lstrip("0")) < 8:
            sys.exit(f"FAILED: loss '{text}' has fewer than 8 significant digits")
    losses = [float(v) for _, v in found]
    return (losses, out.stderr) if with_stderr else losses


def logged_grad_norms(stderr):
    """The `grad norm X` of each step-log line (--log-interval 1: one per step; nan for a skipped step)."""
    return [float(v) for v in re.findall(r"^ step +\d+/\d+ \|.*\| grad norm (\S+) \|", stderr, re.M)]


def expect_curve_close(reference, curve, rtol, name, reference_name="1x1", first=0):
    """Prints `curve` as `name`'s with its largest relative difference to `reference` (the golden:
    the same steps at `reference_name`), and exits naming the first step (numbered from `first`)
    whose loss differs from the reference's by more than `rtol` of it."""
    print(f"{name:26s}:", curve)
    worst = max(abs(a - b) / abs(a) for a, b in zip(reference, curve))
    print(f"{'':26s}  max relative difference to {reference_name}: {worst:.2e}")
    for s, (a, b) in enumerate(zip(reference, curve)):
        if abs(a - b) > rtol * abs(a):
            sys.exit(f"FAILED: step {first + s}: loss {a} at {reference_name} vs {b} at {name} (rtol {rtol})")


def expect_decreasing(curve, what="the loss"):
    """Exits unless the last loss of `curve` is below the first (the model learns at all)."""
    if not curve[-1] < curve[0]:
        sys.exit(f"FAILED: {what} did not decrease: {curve[0]} -> {curve[-1]}")


def read(path):
    with open(path) as f:
        return f.read()


def latest_step(ckpt):
    """The step the checkpoint directory's `latest` names; -1 while there is none (or it is being
    replaced)."""
    try:
        return int(read(os.path.join(ckpt, "latest")).strip().split("-")[1])
    except (OSError, IndexError, ValueError):
        return -1
