#!/usr/bin/env python3
"""Analytic cost model of one meshddp data-parallel step.

Per bucket, in launch order: bucket b becomes ready when the backward pass has produced its last
gradient (r_b); collectives run one after another in bucket order on the DP group (meshddp launches
strictly in order, one stream / one Gloo queue), so

    start_b = max(r_b, end_{b-1}),   end_b = start_b + c(bytes_b)
    exposed = max(0, end_last - T_backward)
    step    = (M - 1) * (fwd + bwd) + fwd + bwd + exposed + optimizer [+ exposed all-gather for ZeRO-1]

(M micro-batches; only the last one syncs, earlier ones accumulate). c() is a ring collective with
latency (alpha, per hop) and bandwidth (beta = 1 / bytes per second) terms:

    all-reduce      2 (p-1) alpha + 2 (p-1)/p * n * beta
    reduce-scatter    (p-1) alpha +   (p-1)/p * n * beta      (all-gather: the same)

on the link the DP ring crosses: NVLink when all DP ranks share a node, InfiniBand otherwise (with
TP = 8 on 8-GPU nodes every DP ring is inter-node, one NIC per GPU; when DP has k > 1 ranks per
node the ring is hierarchical: intra-node reduce-scatter, inter-node all-reduce of n/k, intra-node
all-gather).

Modes
  cpu    read the CPU benchmark's JSON (bench/ddp_bench --mode main), fit Gloo's alpha/beta to the
         standalone all-reduce sweep, take the measured per-parameter gradient-ready times of the
         local run, and predict the 2-rank meshddp step and exposed communication; with --sweep-json
         also the bucket-size sweep. Prints prediction vs measurement.
  scale  a 7B GPT at DP 64..1024 x TP 8 on H100 nodes (constants below, with their sources); prints
         step time, exposed communication and the best bucket size per DP size.
  instances  hierarchical ZeRO-1 (DdpConfig::num_distributed_optimizer_instances = K): per rank and
         step, the bytes on intra-node (NVLink) and inter-node (IB) links and the communication time of
         flat ZeRO-1 (reduce-scatter of the grads and all-gather of the params over all D DP ranks) vs
         K instances (reduce-scatter and all-gather within D/K ranks, all-reduce of the 1/(D/K) shard
         across the K instances), with the optimizer state per rank (x K); says when K pays.
All can write a JSON (--out); bench/plot.py draws cpu and scale.
"""
import argparse
import json
import math
import sys

MiB = 1 << 20


# ------------------------------------------------------------------------------------------------
# The schedule
# ------------------------------------------------------------------------------------------------
def schedule(ready_ms, cost_ms, t_backward_ms):
    """ready_ms[b], cost_ms[b] in launch order -> (exposed_ms, end_ms list)."""
    end = 0.0
    ends = []
    for r, c in zip(ready_ms, cost_ms):
        start = max(r, end)
        end = start + c
        ends.append(end)
    return max(0.0, end - t_backward_ms), ends


def assign_buckets(numels, bytes_per_elem, bucket_bytes):
    """meshddp's assign_buckets without padding: walk params backwards (registration order reversed),
    close a bucket once it holds >= bucket_bytes. Returns lists of param indices in launch order."""
    buckets, cur, cur_bytes = [], [], 0
    for i in reversed(range(len(numels))):
        cur.append(i)
        cur_bytes += numels[i] * bytes_per_elem
        if cur_bytes >= bucket_bytes:
            buckets.append(cur)
            cur, cur_bytes = [], 0
    if cur:
        buckets.append(cur)
    return buckets


# ------------------------------------------------------------------------------------------------
# CPU mode: check against the benchmark
# ------------------------------------------------------------------------------------------------
def fit_alpha_beta(sizes, times_ms, small=64 << 10, large=1 << 20):
    """alpha: the median time of the small collectives (<= 64 KiB: pure latency); beta: the median of
    (t - alpha) / n over the large ones (>= 1 MiB). Robust to the odd slow sample of a loaded machine,
    which an unweighted least-squares line turns into a wrong intercept."""
    def med(v):
        v = sorted(v)
        return v[len(v) // 2] if len(v) % 2 else 0.5 * (v[len(v) // 2 - 1] + v[len(v) // 2])
    a = med([t for s, t in zip(sizes, times_ms) if s <= small])
    b = med([(t - a) / s for s, t in zip(sizes, times_ms) if s >= large])
    return a, b  # ms, ms per byte


def candidate(data, name):
    for c in data["candidates"]:
        if c["name"] == name:
            return c
    return None


def cpu_predict(main, bucket_mb=None, layout=None, a=None, b=None):
    """Predict meshddp's step on the CPU benchmark from the local run's timeline."""
    loc = candidate(main, "local")["median_ms"]
    tl = main["local_grad_ready_ms"]
    ready, numels = tl["ready_ms"], tl["numels"]
    if layout is None:
        layout = assign_buckets(numels, 4, (bucket_mb if bucket_mb is not None else main["bucket_mb"]) * MiB)
    ready_b = [max(ready[i] for i in bucket) for bucket in layout]
    bytes_b = [sum(numels[i] for i in bucket) * 4 for bucket in layout]
    cost_b = [a + b * n for n in bytes_b]
    t_bwd = max(ready)  # the last gradient; the measured backward also includes the engine's tail
    t_bwd = max(t_bwd, loc["bwd"])
    exposed, _ = schedule(ready_b, cost_b, t_bwd)
    step = loc["fwd"] + loc["bwd"] + exposed + loc["opt"]
    no_overlap = loc["fwd"] + loc["bwd"] + sum(cost_b) + loc["opt"]
    return {
        "buckets": len(layout),
        "bucket_bytes": bytes_b,
        "bucket_ready_ms": ready_b,
        "bucket_cost_ms": cost_b,
        "last_bucket_cost_ms": cost_b[-1],
        "sum_cost_ms": sum(cost_b),
        "exposed_ms": exposed,
        "step_ms": step,
        "step_no_overlap_ms": no_overlap,
    }


def cpu_mode(args):
    main = json.load(open(args.bench_json))
    col = main["collectives"]
    a, b = fit_alpha_beta(col["all_reduce_sweep_bytes"], col["all_reduce_sweep_ms"])
    ms = candidate(main, "meshddp")
    layout = [bk["params"] for bk in ms["layout"]]
    pred = cpu_predict(main, layout=layout, a=a, b=b)
    meas = ms["median_ms"]
    out = {
        "mode": "cpu",
        "gloo_alpha_ms": a,
        "gloo_beta_ms_per_MB": b * 1e6,
        "gloo_bandwidth_GBps": 1e-6 / b if b > 0 else None,
        "prediction": pred,
        "measured": {
            "step_ms": meas["total"],
            "exposed_ms": meas["sync"],
            "bwd_ms": meas["bwd"],
            "local_bwd_ms": candidate(main, "local")["median_ms"]["bwd"],
            "standalone_bucket_all_reduce_ms": col["bucket_all_reduce_ms"],
        },
    }
    print(f"# Gloo fit (2 ranks, loopback): alpha = {a:.3f} ms, beta = {b * 1e6:.2f} ms/MB "
          f"({1e-6 / b:.2f} GB/s)")
    print(f"# meshddp, {pred['buckets']} buckets of {main['bucket_mb']} MiB")
    print(f"{'':28s} {'predicted':>10s} {'measured':>10s}")
    print(f"{'step (ms)':28s} {pred['step_ms']:10.1f} {meas['total']:10.1f}   "
          f"(shared cores, no overlap: {pred['step_no_overlap_ms']:.1f})")
    print(f"{'exposed comm (ms)':28s} {pred['exposed_ms']:10.1f} {meas['sync']:10.1f}")
    print(f"{'sum of bucket collectives':28s} {pred['sum_cost_ms']:10.1f} {sum(col['bucket_all_reduce_ms']):10.1f}")
    print(f"{'last bucket collective':28s} {pred['last_bucket_cost_ms']:10.1f} {col['bucket_all_reduce_ms'][-1]:10.1f}")
    print(f"{'backward (ms)':28s} {candidate(main, 'local')['median_ms']['bwd']:10.1f} {meas['bwd']:10.1f}"
          "   (predicted = local's; measured = meshddp's, with its hooks and the comm threads)")
    if args.sweep_json:
        sw = json.load(open(args.sweep_json))
        rows = []
        for c in sw["candidates"]:
            if not c["name"].startswith("meshddp_"):
                continue
            # The sweep's own local run (times and gradient-ready timeline) when it has one: the
            # load on this machine differs between runs.
            base = sw if "local_grad_ready_ms" in sw else main
            p = cpu_predict(base, bucket_mb=c["bucket_mb"], a=a, b=b)
            rows.append({"bucket_mb": c["bucket_mb"], "predicted_step_ms": p["step_ms"],
                         "predicted_exposed_ms": p["exposed_ms"], "predicted_step_shared_cores_ms": p["step_no_overlap_ms"],
                         "predicted_exposed_shared_cores_ms": p["sum_cost_ms"],
                         "measured_step_ms": c["median_ms"]["total"],
                         "measured_exposed_ms": c["median_ms"]["sync"]})
        rows.sort(key=lambda r: r["bucket_mb"])
        out["sweep"] = rows
        print("\n# bucket-size sweep: predicted vs measured (ms); the default is 40 MiB")
        print("# 'overlap': collectives run beside backward for free (spare cores / a GPU's copy engines);")
        print("# 'shared': they take the same cores as compute (this 2-core box, 2 ranks x 1 thread): no overlap")
        print(f"{'MiB':>6s} {'step overlap':>12s} {'step shared':>12s} {'step meas':>10s} {'exp overlap':>12s} "
              f"{'exp shared':>11s} {'exp meas':>9s}")
        for r in rows:
            print(f"{r['bucket_mb']:6g} {r['predicted_step_ms']:12.1f} {r['predicted_step_shared_cores_ms']:12.1f} "
                  f"{r['measured_step_ms']:10.1f} {r['predicted_exposed_ms']:12.1f} "
                  f"{r['predicted_exposed_shared_cores_ms']:11.1f} {r['measured_exposed_ms']:9.1f}")
    return out


# ------------------------------------------------------------------------------------------------
# Scale mode: 7B GPT, DP x TP 8, H100 nodes
# ------------------------------------------------------------------------------------------------
# Assumed constants (per GPU), with where they come from:
H100 = {
    # NVIDIA H100 SXM datasheet: 989 TFLOP/s dense BF16. Megatron-LM reports 40-50% MFU for GPT
    # models at this size with TP 8 (Narayanan et al. 2021; Megatron-core GPT benchmarks); 45% also
    # absorbs the TP all-reduces inside forward/backward, which this model does not schedule.
    "peak_tflops": 989.0,
    "mfu": 0.45,
    # NVLink 4: 900 GB/s bidirectional per GPU (datasheet); nccl-tests all-reduce bus bandwidth on
    # one DGX H100 is ~450 GB/s -> 360 GB/s per direction for a ring hop is a conservative round number.
    "nvlink_GBps": 360.0,
    "nvlink_alpha_us": 2.0,
    # One ConnectX-7 400 Gb/s NIC per GPU (DGX H100 / most H100 clusters): 50 GB/s line rate;
    # nccl-tests inter-node bus bandwidth reaches ~40-45 GB/s per GPU. Per-hop latency of NCCL's
    # Simple protocol over IB: ~5-10 us (NCCL tuning tables); 6 us here.
    "ib_GBps": 40.0,
    "ib_alpha_us": 6.0,
    # HBM3 3.35 TB/s; a fused AdamW touches ~16-20 bytes per fp32 param (master read/write, two
    # moments read/write, grad read): ~2 TB/s effective.
    "hbm_GBps": 2000.0,
    "gpus_per_node": 8,
}

GPT7B = {"layers": 32, "hidden": 4096, "vocab": 50304, "seq": 4096}


ALGO = {"all_reduce": "ring"}  # --allreduce-algo: "ring", or "best" = min(ring, tree) like NCCL's tuner


def ring_cost_ms(kind, nbytes, p, alpha_us, GBps):
    if p <= 1:
        return 0.0
    hops = 2 * (p - 1) if kind == "all_reduce" else (p - 1)
    vol = (2 if kind == "all_reduce" else 1) * (p - 1) / p * nbytes
    ring = hops * alpha_us * 1e-3 + vol / (GBps * 1e9) * 1e3
    if kind == "all_reduce" and ALGO["all_reduce"] == "best":
        # NCCL's double binary tree: 2 log2(p) latency steps, ~2 n of traffic per rank (pipelined).
        tree = 2 * math.ceil(math.log2(p)) * alpha_us * 1e-3 + 2 * nbytes / (GBps * 1e9) * 1e3
        return min(ring, tree)
    return ring


def dp_collective_ms(kind, nbytes, dp, tp, hw):
    """A DP collective of nbytes per rank (the bucket), on the links the DP group crosses."""
    per_node = max(1, hw["gpus_per_node"] // tp)  # DP ranks sharing a node
    if dp <= per_node:  # all DP ranks in one node
        return ring_cost_ms(kind, nbytes, dp, hw["nvlink_alpha_us"], hw["nvlink_GBps"])
    if per_node == 1:   # one DP rank per node: a flat inter-node ring, one NIC per GPU
        return ring_cost_ms(kind, nbytes, dp, hw["ib_alpha_us"], hw["ib_GBps"])
    nodes = dp // per_node  # hierarchical: intra RS, inter (kind) on nbytes / per_node, intra AG
    t = ring_cost_ms("reduce_scatter", nbytes, per_node, hw["nvlink_alpha_us"], hw["nvlink_GBps"])
    t += ring_cost_ms(kind, nbytes / per_node, nodes, hw["ib_alpha_us"], hw["ib_GBps"])
    if kind == "all_reduce":
        t += ring_cost_ms("all_gather", nbytes, per_node, hw["nvlink_alpha_us"], hw["nvlink_GBps"])
    return t


# ------------------------------------------------------------------------------------------------
# Instances mode: hierarchical ZeRO-1 (Megatron's num_distributed_optimizer_instances)
# ------------------------------------------------------------------------------------------------
def link_bytes(kind, nbytes, ranks_per_node, nodes):
    """Per-rank bytes sent by a ring collective of nbytes (the input of a reduce-scatter / all-reduce,
    the output of an all-gather) over a group of ranks_per_node ranks on each of `nodes` nodes, run as
    NCCL does across nodes: intra-node reduce-scatter, inter-node `kind` on nbytes / ranks_per_node,
    intra-node all-gather (all-reduce only). Returns (intra_node_bytes, inter_node_bytes)."""
    a, b = ranks_per_node, nodes
    factor = 2 if kind == "all_reduce" else 1
    intra = factor * (a - 1) / a * nbytes
    inter = factor * (b - 1) / b * nbytes / a
    return intra, inter


def link_time_ms(kind, nbytes, ranks_per_node, nodes, hw, buckets):
    """Time of `buckets` such collectives (nbytes in all): ring latency per hop and bucket, bytes at the
    link's bandwidth, intra- and inter-node parts one after the other."""
    intra, inter = link_bytes(kind, nbytes, ranks_per_node, nodes)
    factor = 2 if kind == "all_reduce" else 1
    t = intra / (hw["nvlink_GBps"] * 1e9) * 1e3 + inter / (hw["ib_GBps"] * 1e9) * 1e3
    t += buckets * factor * ((ranks_per_node - 1) * hw["nvlink_alpha_us"] + (nodes - 1) * hw["ib_alpha_us"]) * 1e-3
    return t


def group_shape(size, stride, per_node):
    """(ranks per node, nodes) of a group of `size` DP ranks taken every `stride` consecutive DP ranks,
    DP ranks laid out node-major with `per_node` of them per node."""
    on_node = max(1, min(size, per_node // stride)) if stride < per_node else 1
    return on_node, size // on_node


def zero1_traffic(params, dp, tp, instances, hw, grad_bytes, param_bytes, bucket_mb, state_bytes=12):
    """Per rank and step: bytes per link and time of ZeRO-1's gradient and param collectives, and the
    optimizer state bytes, for `instances` K (1 = flat). `params` per GPU (its TP shard)."""
    per_node = max(1, hw["gpus_per_node"] // tp)  # DP ranks sharing a node
    inst = dp // instances
    g, p = params * grad_bytes, params * param_bytes
    buckets = max(1, math.ceil(g / (bucket_mb * MiB)))
    shape = group_shape(inst, 1, per_node)  # an instance: consecutive DP ranks
    parts = [("reduce_scatter", g, shape), ("all_gather", p, shape)]
    if instances > 1:  # the shard, across instances: every inst-th DP rank
        parts.append(("all_reduce", g / inst, group_shape(instances, inst, per_node)))
    intra = inter = t = 0.0
    for kind, n, (a, b) in parts:
        i, e = link_bytes(kind, n, a, b)
        intra, inter = intra + i, inter + e
        t += link_time_ms(kind, n, a, b, hw, buckets)
    return {"instances": instances, "instance_size": inst, "intra_node_GB": intra / 1e9, "inter_node_GB": inter / 1e9,
            "comm_ms": t, "optimizer_state_GB": params / inst * state_bytes / 1e9, "buckets": buckets}


def instances_mode(args):
    hw = dict(H100)
    hw["ib_GBps"], hw["ib_alpha_us"] = args.ib_GBps, args.ib_alpha_us
    model = dict(GPT7B)
    params = sum(n for _, n, _ in gpt_layers(model, args.tp, model["seq"]))
    print(f"# hierarchical ZeRO-1: 7B GPT, TP {args.tp} ({params / 1e6:.0f} M params per GPU), "
          f"{hw['gpus_per_node']} GPUs per node, grads {args.grad_bytes} B, params {args.param_bytes} B, "
          f"{args.bucket_mb:g} MiB buckets; NVLink {hw['nvlink_GBps']} GB/s + {hw['nvlink_alpha_us']} us/hop, "
          f"IB {hw['ib_GBps']} GB/s + {hw['ib_alpha_us']} us/hop; per rank and step")
    print(f"{'DP':>5s} {'K':>4s} {'D/K':>5s} {'NVLink GB':>10s} {'IB GB':>8s} {'comm ms':>8s} {'state GB':>9s}   verdict")
    rows = []
    for dp in [int(x) for x in args.dp.split(",")]:
        flat = zero1_traffic(params, dp, args.tp, 1, hw, args.grad_bytes, args.param_bytes, args.bucket_mb)
        for k in [int(x) for x in args.instances.split(",")]:
            if dp % k:
                continue
            r = zero1_traffic(params, dp, args.tp, k, hw, args.grad_bytes, args.param_bytes, args.bucket_mb)
            r["dp"] = dp
            r["saves_ms"] = flat["comm_ms"] - r["comm_ms"]
            verdict = "flat" if k == 1 else (f"pays: {r['saves_ms']:.1f} ms less comm, state x{k}" if r["saves_ms"] > 0
                                             else f"costs {-r['saves_ms']:.1f} ms more comm, state x{k}")
            rows.append(r)
            print(f"{dp:5d} {k:4d} {r['instance_size']:5d} {r['intra_node_GB']:10.2f} {r['inter_node_GB']:8.2f} "
                  f"{r['comm_ms']:8.1f} {r['optimizer_state_GB']:9.2f}   {verdict}")
    return {"mode": "instances", "hardware": hw, "model": model, "tp": args.tp, "grad_bytes": args.grad_bytes,
            "param_bytes": args.param_bytes, "bucket_mb": args.bucket_mb, "params_per_gpu": params, "rows": rows}


def gpt_layers(model, tp, tokens):
    """Per-GPU (numel, fwd FLOPs) of each parameter group, in registration order: embedding, the
    transformer layers, the output head (untied)."""
    h, s, V = model["hidden"], model["seq"], model["vocab"]
    layer_params = 12 * h * h + 13 * h  # QKV, proj, 4h MLP, biases, 2 norms
    layer_flops = 2 * tokens * 12 * h * h + 2 * 2 * tokens * s * h  # matmuls + causal attention (flash: half of 4 t s h)
    groups = [("embedding", V * h // tp, 0.0)]
    groups += [(f"layer{i}", layer_params // tp, layer_flops / tp) for i in range(model["layers"])]
    groups += [("head", V * h // tp, 2 * tokens * h * V / tp)]
    return groups


def scale_step(dp, tp, bucket_mb, zero1, hw, model, global_seqs, micro_seqs, grad_bytes, overlap_gather=True,
               layer_bwd_ms=None):
    micro_batches = max(1, global_seqs // (dp * micro_seqs))
    tokens = micro_seqs * model["seq"]
    groups = gpt_layers(model, tp, tokens)
    flops_per_s = hw["peak_tflops"] * 1e12 * hw["mfu"]
    fwd_ms = [f / flops_per_s * 1e3 for _, _, f in groups]
    if layer_bwd_ms is not None:  # measured: every FLOP-based time scaled so a layer's backward is this
        layer_fwd = fwd_ms[1]
        fwd_ms = [f * (layer_bwd_ms / 2) / layer_fwd for f in fwd_ms]
    bwd_ms = [2 * f for f in fwd_ms]
    fwd, bwd = sum(fwd_ms), sum(bwd_ms)
    # Gradient-ready times: backward runs the groups in reverse order.
    ready, t = [0.0] * len(groups), 0.0
    for i in reversed(range(len(groups))):
        t += bwd_ms[i]
        ready[i] = t
    numels = [n for _, n, _ in groups]
    layout = assign_buckets(numels, grad_bytes, bucket_mb * MiB)
    ready_b = [max(ready[i] for i in bk) for bk in layout]
    bytes_b = [sum(numels[i] for i in bk) * grad_bytes for bk in layout]
    kind = "reduce_scatter" if zero1 else "all_reduce"
    cost_b = [dp_collective_ms(kind, n, dp, tp, hw) for n in bytes_b]
    exposed, _ = schedule(ready_b, cost_b, bwd)
    params = sum(numels)
    # Optimizer: AdamW over this rank's params (ZeRO-1: its 1/dp shard), ~20 bytes per param of HBM traffic.
    opt_ms = params / (dp if zero1 else 1) * 20 / (hw["hbm_GBps"] * 1e9) * 1e3
    gather_exposed = 0.0
    gather_total = 0.0
    if zero1:  # bf16 params all-gathered per bucket; overlapped with the next forward in forward order
        gcost = [dp_collective_ms("all_gather", sum(numels[i] for i in bk) * 2, dp, tp, hw) for bk in layout]
        gather_total = sum(gcost)
        if overlap_gather:
            # forward needs bucket b (launch order reversed = forward order) before its first group
            order = list(reversed(range(len(layout))))
            need, t_fwd = {}, 0.0
            first_group = {b: min(layout[b]) for b in range(len(layout))}
            cum = [0.0]
            for f in fwd_ms:
                cum.append(cum[-1] + f)
            end = 0.0
            for b in order:
                end += gcost[b]
                gather_exposed = max(gather_exposed, end - cum[first_group[b]])
            gather_exposed = max(0.0, gather_exposed)
        else:
            gather_exposed = gather_total
    step = micro_batches * (fwd + bwd) + exposed + opt_ms + gather_exposed
    compute = micro_batches * (fwd + bwd)
    return {
        "dp": dp, "tp": tp, "bucket_mb": bucket_mb, "zero1": zero1, "micro_batches": micro_batches,
        "params_per_gpu": params, "buckets": len(layout), "compute_ms": compute, "fwd_ms": fwd, "bwd_ms": bwd,
        "comm_total_ms": sum(cost_b), "last_bucket_ms": cost_b[-1], "exposed_ms": exposed,
        "gather_total_ms": gather_total, "gather_exposed_ms": gather_exposed, "opt_ms": opt_ms,
        "step_ms": step, "efficiency": compute / step,
    }


def scale_mode(args):
    hw = dict(H100)
    hw["ib_GBps"] = args.ib_GBps
    hw["ib_alpha_us"] = args.ib_alpha_us
    hw["mfu"] = args.mfu
    ALGO["all_reduce"] = args.allreduce_algo
    model = dict(GPT7B)
    bucket_choices = [float(x) for x in args.buckets.split(",")]
    dps = [int(x) for x in args.dp.split(",")]
    results = []
    print(f"# 7B GPT ({model['layers']} layers, h {model['hidden']}, seq {model['seq']}), TP {args.tp}, "
          f"global batch {args.global_seqs} x {model['seq']} tokens, micro-batch {args.micro_seqs}, "
          f"grads {args.grad_bytes} B, H100: "
          + (f"measured layer backward {args.layer_bwd_ms} ms" if args.layer_bwd_ms else f"{hw['mfu']:.0%} MFU")
          + f", IB {hw['ib_GBps']} GB/s + {hw['ib_alpha_us']} us/hop, all-reduce {args.allreduce_algo}")
    print(f"{'mode':6s} {'DP':>5s} {'mb':>3s} {'bucket':>7s} {'step':>8s} {'compute':>8s} {'comm':>7s} "
          f"{'exposed':>8s} {'last':>6s} {'eff':>5s}   best bucket (step)")
    for zero1 in (False, True):
        for dp in dps:
            rows = [scale_step(dp, args.tp, bmb, zero1, hw, model, args.global_seqs, args.micro_seqs, args.grad_bytes,
                               layer_bwd_ms=args.layer_bwd_ms)
                    for bmb in bucket_choices]
            default = next(r for r in rows if r["bucket_mb"] == 40.0) if 40.0 in bucket_choices else rows[0]
            best = min(rows, key=lambda r: r["step_ms"])
            results.append({"dp": dp, "zero1": zero1, "default": default, "best": best, "by_bucket": rows})
            print(f"{'zero1' if zero1 else 'ar':6s} {dp:5d} {default['micro_batches']:3d} {40:5g}MB "
                  f"{default['step_ms']:8.1f} {default['compute_ms']:8.1f} {default['comm_total_ms']:7.1f} "
                  f"{default['exposed_ms'] + default['gather_exposed_ms']:8.1f} {default['last_bucket_ms']:6.1f} "
                  f"{default['efficiency']:5.2f}   {best['bucket_mb']:g} MiB ({best['step_ms']:.1f} ms)")
    return {"mode": "scale", "allreduce_algo": args.allreduce_algo, "layer_bwd_ms": args.layer_bwd_ms, "hardware": hw, "model": model, "tp": args.tp, "global_seqs": args.global_seqs,
            "micro_seqs": args.micro_seqs, "grad_bytes": args.grad_bytes, "results": results}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("cpu", help="check against the CPU benchmark")
    c.add_argument("bench_json")
    c.add_argument("--sweep-json")
    c.add_argument("--out")
    s = sub.add_parser("scale", help="7B GPT at DP 64..1024 x TP 8 on H100")
    s.add_argument("--dp", default="64,128,256,512,1024")
    s.add_argument("--tp", type=int, default=8)
    s.add_argument("--buckets", default="5,10,25,40,100,250,1000")
    s.add_argument("--global-seqs", type=int, default=1024, help="sequences per step (1024 x 4096 = 4M tokens)")
    s.add_argument("--micro-seqs", type=int, default=1)
    s.add_argument("--grad-bytes", type=int, default=2, help="2 = bf16 grads reduced in bf16, 4 = fp32 main grads")
    s.add_argument("--ib-GBps", type=float, default=H100["ib_GBps"])
    s.add_argument("--ib-alpha-us", type=float, default=H100["ib_alpha_us"])
    s.add_argument("--mfu", type=float, default=H100["mfu"])
    s.add_argument("--layer-bwd-ms", type=float, default=None,
                   help="measured backward time of one transformer layer per micro-batch (ms) on the GPU; "
                        "replaces the FLOPs/MFU estimate (forward = half; embedding/head scaled alike)")
    s.add_argument("--allreduce-algo", choices=["ring", "best"], default="ring",
                   help="best: NCCL-like min(ring, double binary tree) for all-reduce (RS/AG stay ring)")
    s.add_argument("--out")
    h = sub.add_parser("instances", help="hierarchical ZeRO-1: bytes per link, time and state, flat vs K instances")
    h.add_argument("--dp", default="16,64,256,1024")
    h.add_argument("--tp", type=int, default=1)
    h.add_argument("--instances", default="1,2,4,8,16,32,64,128")
    h.add_argument("--grad-bytes", type=int, default=4, help="4 = fp32 main grads (Megatron's default), 2 = bf16")
    h.add_argument("--param-bytes", type=int, default=2, help="the all-gathered params: 2 = bf16")
    h.add_argument("--bucket-mb", type=float, default=40.0)
    h.add_argument("--ib-GBps", type=float, default=H100["ib_GBps"])
    h.add_argument("--ib-alpha-us", type=float, default=H100["ib_alpha_us"])
    h.add_argument("--out")
    args = ap.parse_args()
    out = {"cpu": cpu_mode, "scale": scale_mode, "instances": instances_mode}[args.mode](args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"# wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
