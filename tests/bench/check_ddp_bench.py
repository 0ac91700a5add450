"""Smoke test of bench/ddp_bench (not a timing test): a tiny model at 2 ranks, 1 warm-up + 2 reps;
checks every candidate ran and reported, the memory figures hold (meshddp's gradients are one copy,
the copying Reducer holds two, ZeRO-1 halves the optimizer state at DP 2), and that
bench/cost_model.py reads the JSON. Then a tiny GPT (--model gpt) in fp32 and in bf16 with every
candidate: the JSON's model fields and parameter count (closed form), the gradient and optimizer
memory per dtype (bf16 params keep bf16 grads in meshddp; meshddp_fp32_grads holds fp32 grads and fp32
masters), and that every DDP candidate trained the same model (their last losses agree). First, that
bad flags exit 2 naming the flag (the examples' strict parsers)."""
import json
import os
import subprocess
import sys
import tempfile

binary, cost_model = sys.argv[1], sys.argv[2]

# Bad flags are refused by the examples' strict parsers (examples/common/flags.h), before any
# rendezvous: exit 2, the flag named, the usage printed (no torchrun needed).
for args, message in [(["--batch", "1e3"], "error: --batch: '1e3' is not an integer"),
                      (["--reps", "0"], "error: --reps must be in [1, "),
                      (["--model", "bert"], "error: --model: 'bert' is not one of mlp, gpt")]:
    out = subprocess.run([binary] + args, capture_output=True, text=True, timeout=60)
    if out.returncode != 2 or message not in out.stderr or "usage: " not in out.stderr:
        sys.exit(f"FAILED: ddp_bench {' '.join(args)}: exit {out.returncode}, want 2 and '{message}'\n{out.stderr}")

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

    # A tiny GPT, fp32 and bf16, every candidate (no standalone collectives: --collective-reps 0).
    L, H, HEADS, S, V = 2, 32, 4, 16, 64
    gpt_params = L * (12 * H * H + 13 * H) + V * H + S * H + 2 * H + H * V  # blocks, embeddings, ln_f, head
    ddp = ["meshddp", "meshddp_autograd", "meshddp_no_overlap", "meshddp_zero1", "meshddp_fp32_grads",
           "meshddp_zero1_fp32_grads", "reducer_view", "reducer_copy", "naive"]
    # Every DDP candidate trains on the DP mean of the same batches from the same weights, so their last
    # losses agree: in fp32 all of them, to the 8 digits of the JSON (measured: identical; local, on rank
    # 0's batch alone, is 5e-4 away). In bf16, two groups, each identical within (measured): bf16 params
    # stepped in bf16 (meshddp, the Reducer, naive: local's arithmetic), and fp32 masters (ZeRO-1,
    # fp32 main grads), 2.6e-5 from the first (local: 7.8e-5).
    fp32_masters = ["meshddp_zero1", "meshddp_fp32_grads", "meshddp_zero1_fp32_grads"]
    runs = {}
    for dtype in ["fp32", "bf16"]:  # both at once: most of each run is process start-up
        path3 = os.path.join(tmp, f"gpt_{dtype}.json")
        cmd3 = cmd[:cmd.index("--layers")] + [
            "--model", "gpt", "--dtype", dtype, "--layers", str(L), "--hidden", str(H), "--heads", str(HEADS),
            "--seq", str(S), "--vocab", str(V), "--batch", "2", "--warmup", "1", "--reps", "2", "--collective-reps", "0",
            "--candidates", ",".join(["local"] + ddp), "--json", path3]
        runs[dtype] = (cmd3, path3, subprocess.Popen(cmd3, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for dtype, size in [("fp32", 4), ("bf16", 2)]:
        cmd3, path3, proc = runs[dtype]
        stdout, stderr = proc.communicate(timeout=120)
        if proc.returncode != 0:
            sys.exit(f"FAILED: {' '.join(cmd3)} exited {proc.returncode}\n{stdout}\n{stderr}")
        d = json.load(open(path3))
        g = {x["name"]: x for x in d["candidates"]}
        fail = lambda what: sys.exit(f"FAILED: gpt {dtype}: {what}: {json.dumps(d)[:3000]}")
        if sorted(g) != sorted(["local"] + ddp):
            fail(f"candidates {sorted(g)}")
        if (d["model"], d["dtype"], d["layers"], d["hidden"], d["heads"], d["seq"], d["vocab"]) != ("gpt", dtype, L, H, HEADS, S, V):
            fail("model fields")
        if d["params"] != gpt_params:
            fail(f"params {d['params']} != {gpt_params} (closed form)")
        for name, x in g.items():
            if len(x["total_ms"]) != 2 or not x["median_ms"]["total"] > 0 or not x["last_loss"] > 0:
                fail(name)
        n = gpt_params
        checks = [
            (g["local"]["param_bytes"] == n * size, "params in the dtype"),
            (g["meshddp"]["grad_and_comm_bytes"] == n * size, "meshddp grads: one copy, in the param dtype"),
            (g["meshddp_fp32_grads"]["grad_and_comm_bytes"] == n * 4, "fp32 main grads"),
            # SGD momentum in the param dtype; meshddp_fp32_grads: fp32 momentum + fp32 masters
            (g["local"]["optimizer_state_bytes"] == n * size, "local: momentum in the param dtype"),
            (g["meshddp_fp32_grads"]["optimizer_state_bytes"] == (n * 8 if dtype == "bf16" else n * 4), "fp32 masters"),
        ]
        for ok, what in checks:
            if not ok:
                fail(what)
        for name in ddp:
            ref = "meshddp_zero1" if dtype == "bf16" and name in fp32_masters else "meshddp"
            if abs(g[name]["last_loss"] - g[ref]["last_loss"]) > 1e-6 * abs(g[ref]["last_loss"]):
                fail(f"{name}'s last loss {g[name]['last_loss']} != {ref}'s {g[ref]['last_loss']} (rel. tol 1e-6)")
print("1 passed, 0 failed")
