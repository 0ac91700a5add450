"""Peak memory per rank and step time of example 02 under each data-parallel sharding strategy
(docs/guide/sharding.md), launched by torchrun on CPU (Gloo). Prints a markdown table: per strategy the
gradient storage each rank reports (GradBuffer::grad_buffer_bytes: the whole flat buffer, or the shards
plus the pool's blocks), each rank's peak RSS (getrusage), and the mean step time of the example's step
log. Usage:
  python bench/sharding_memory_bench.py build/examples/gpt_example [--nproc 4] [--steps 4] -- <example flags>
e.g. -- --layers 8 --dim 512 --heads 8 --global-batch 16 --bucket-bytes 4194304"""
import argparse
import os
import re
import subprocess
import sys

parser = argparse.ArgumentParser()
parser.add_argument("binary")
parser.add_argument("--nproc", type=int, default=4)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--strategies", default="optim,optim_grads")
split = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
a = parser.parse_args(sys.argv[1:split])
flags = sys.argv[split + 1:]  # the example's own flags
torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
print(f"command: torchrun --standalone --nproc-per-node={a.nproc} {a.binary} --dp {a.nproc} --steps {a.steps} "
      f"{' '.join(flags)} --data-parallel-sharding-strategy S")
print()
print("| strategy | gradient storage per rank (MB) | peak RSS per rank (MB) | mean step time (ms) |")
print("|---|---|---|---|")
for strategy in a.strategies.split(","):
    cmd = [torchrun, "--standalone", f"--nproc-per-node={a.nproc}", "--no-python", a.binary, "--dp", str(a.nproc),
           "--steps", str(a.steps), "--data-parallel-sharding-strategy", strategy, *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stderr[-4000:]}")
    ranks = re.findall(r"# gradient storage on rank (\d+): (\d+) bytes \(\S+\), peak RSS (\d+) KiB", out.stderr)
    step = re.search(r"mean step time ([\d.]+) ms", out.stderr)
    grads = sorted({round(int(b) / 1e6, 1) for _, b, _ in ranks})
    rss = [round(int(k) / 1024) for _, _, k in sorted(ranks, key=lambda r: int(r[0]))]
    print(f"| {strategy} | {', '.join(map(str, grads))} | {', '.join(map(str, rss))} | "
          f"{step.group(1) if step else '?'} |")
