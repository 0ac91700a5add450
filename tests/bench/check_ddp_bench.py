"""Smoke test of bench/ddp_bench (not a timing test): a tiny model at 2 ranks, 1 warm-up + 2 reps;
checks every candidate ran and reported, the memory figures hold (meshddp's gradients are one copy,
the copying Reducer holds two, ZeRO-1 halves the optimizer state at DP 2), and that
bench/cost_model.py reads the JSON."""
import json
import os
import subprocess
import sys
import tempfile

binary, cost_model = sys.argv[1], sys.argv[2]
torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "bench.json")
    cmd = [torchrun, "--standalone", "--nproc-per-node=2", "--no-python", binary, "--layers", "3", "--hidden", "64",
           "--batch", "4", "--warmup", "1", "--reps", "2", "--collective-reps", "1", "--bucket-mb", "0.02",
           "--json", path]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)} exited {out.returncode}\n{out.stdout}\n{out.stderr}")
    data = json.load(open(path))
    c = {x["name"]: x for x in data["candidates"]}
    want = ["local", "meshddp", "meshddp_autograd", "meshddp_no_overlap", "meshddp_zero1", "reducer_view", "reducer_copy", "naive"]
    if sorted(c) != sorted(want):
        sys.exit(f"FAILED: candidates {sorted(c)} != {sorted(want)}")
    for name, x in c.items():
        if len(x["total_ms"]) != 2 or not x["median_ms"]["total"] > 0:
            sys.exit(f"FAILED: {name}: {x}")
    grad_bytes = data["params"] * 4
    checks = [
        (c["meshddp"]["grad_and_comm_bytes"] == grad_bytes, "meshddp grads are one copy"),
        (c["reducer_view"]["grad_and_comm_bytes"] == grad_bytes, "Reducer with bucket views: one copy"),
        (c["reducer_copy"]["grad_and_comm_bytes"] == 2 * grad_bytes, "Reducer without: two copies"),
        (c["meshddp"]["buckets"] > 1 and c["meshddp"]["buckets_launched_by_hooks_median"] >= 1, "hooks launch"),
        (c["meshddp_zero1"]["optimizer_state_bytes"] < 0.6 * c["meshddp"]["optimizer_state_bytes"], "ZeRO-1 shards"),
    ]
    for ok, what in checks:
        if not ok:
            sys.exit(f"FAILED: {what}: {json.dumps(data)[:3000]}")
    out = subprocess.run([sys.executable, cost_model, "cpu", path], capture_output=True, text=True, timeout=60)
    if out.returncode != 0 or "exposed comm" not in out.stdout:
        sys.exit(f"FAILED: cost_model cpu: {out.stdout}\n{out.stderr}")
    # The candidates not in the default list: the bf16 communication hooks (meshddp's and the Reducer's).
    hooks = ["meshddp_bf16", "meshddp_zero1_bf16", "reducer_bf16"]
    path2 = os.path.join(tmp, "hooks.json")
    cmd2 = cmd[:cmd.index("--json")] + ["--candidates", ",".join(hooks), "--json", path2]
    out = subprocess.run(cmd2, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd2)} exited {out.returncode}\n{out.stdout}\n{out.stderr}")
    got = sorted(x["name"] for x in json.load(open(path2))["candidates"])
    if got != sorted(hooks):
        sys.exit(f"FAILED: candidates {got} != {sorted(hooks)}")
print("1 passed, 0 failed")
