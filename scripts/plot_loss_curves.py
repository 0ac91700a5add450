"""Trains the tiny GPT (examples/02_dp_x_tp_gpt) at DP x TP = 1x1 and 2x2 (and 2x2 with sequence
parallelism) with the same seed and global batch, and plots the loss curves on one figure:
docs/loss_curves.png. Usage: .venv/bin/python scripts/plot_loss_curves.py [--steps 40]"""
import argparse
import os
import re
import subprocess

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--out", default=os.path.join(root, "docs", "loss_curves.png"))
args = parser.parse_args()
torchrun = os.path.join(root, ".venv", "bin", "torchrun")
binary = os.path.join(os.environ.get("MESHDDP_BUILD_DIR", os.path.join(root, "build")), "examples", "gpt_example")


def curve(dp, tp, *extra):
    cmd = [torchrun, "--standalone", f"--nproc-per-node={dp * tp}", "--no-python", binary, "--dp", str(dp), "--tp",
           str(tp), "--steps", str(args.steps), *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return [float(v) for v in re.findall(r"^step \d+ loss (\S+)$", out, re.M)]


runs = {"1x1 (one process)": curve(1, 1), "2x2 (DP 2 x TP 2)": curve(2, 2),
        "2x2, sequence parallel": curve(2, 2, "--sequence-parallel")}
plt.figure(figsize=(7, 4))
styles = ["-", "--", ":"]
for (name, losses), style in zip(runs.items(), styles):
    plt.plot(range(len(losses)), losses, style, linewidth=2, label=name)
ref = runs["1x1 (one process)"]
worst = max(abs(a - b) / abs(a) for losses in runs.values() for a, b in zip(ref, losses))
plt.title(f"tiny GPT, same seed and global batch (max relative difference {worst:.1e})")
plt.xlabel("step")
plt.ylabel("mean loss over the global batch")
plt.legend()
plt.grid(alpha=0.3)
plt.tight_layout()
plt.savefig(args.out, dpi=110)
print(f"wrote {args.out}; max relative difference to 1x1: {worst:.2e}")
