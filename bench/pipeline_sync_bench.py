"""How much DP gradient communication the pipeline schedule hides: runs examples/02_dp_x_tp_gpt at
dp 2 x pp 2 (1F1B) twice, with each chunk's sync started when its last backward ends (in the
pipeline's cool-down bubble: --grad-sync bubble) and with all of it held until the schedule ends
(--grad-sync end), and prints the exposed sync time per step (from the schedule's end until every
gradient is final, the max over ranks, steps 1.. averaged) of each and their ratio.

    .venv/bin/python bench/pipeline_sync_bench.py build/examples/gpt_example [--repeats 3] [model flags...]

Model flags after the binary replace the defaults (a GPT big enough that the DP all-reduce costs
milliseconds on Gloo). Each setting runs --repeats times; the median is reported."""
import os
import re
import statistics
import subprocess
import sys

binary = sys.argv[1]
args = sys.argv[2:]
repeats = 3
if args[:1] == ["--repeats"]:
    repeats, args = int(args[1]), args[2:]
model = args or ["--layers", "4", "--dim", "256", "--heads", "4", "--seq-len", "64", "--vocab", "1024",
                 "--global-batch", "16", "--steps", "8"]
torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
PATTERN = re.compile(r"gradient sync exposed after the schedule \(([^)]*)\): ([0-9.]+) ms/step; schedule ([0-9.]+)")


def measure(placement):
    cmd = [torchrun, "--standalone", "--nproc-per-node=4", "--no-python", binary, "--dp", "2", "--pp", "2",
           "--micro-batches", "4", "--grad-sync", placement, *model]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    found = PATTERN.search(out.stderr)
    if out.returncode != 0 or not found:
        sys.exit(f"FAILED: {' '.join(cmd)} exited {out.returncode}\n{out.stderr[-3000:]}")
    return float(found.group(2)), float(found.group(3))


print(f"load average before: {os.getloadavg()[0]:.2f} (cores: {os.cpu_count()})")
results = {}
for placement in ("bubble", "end"):
    runs = [measure(placement) for _ in range(repeats)]
    exposed = statistics.median(r[0] for r in runs)
    schedule = statistics.median(r[1] for r in runs)
    results[placement] = exposed
    print(f"--grad-sync {placement:6s}: exposed sync {exposed:8.3f} ms/step (runs: "
          f"{', '.join(f'{r[0]:.3f}' for r in runs)}), schedule {schedule:8.3f} ms/step")
print(f"load average after: {os.getloadavg()[0]:.2f}")
ratio = results["bubble"] / results["end"] if results["end"] > 0 else float("nan")
print(f"exposed sync, started in the bubble / all at the end: {ratio:.3f} "
      f"({100 * (1 - ratio):.0f}% of the end-of-step sync hidden)")
