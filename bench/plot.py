#!/usr/bin/env python3
"""Draws the benchmark figures into docs/ from the JSON records in bench/results/.

    .venv/bin/python bench/plot.py            # reads bench/results/*.json, writes docs/bench_*.png
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RES = os.path.join(ROOT, "bench", "results")
DOCS = os.path.join(ROOT, "docs")


def load(name):
    path = os.path.join(RES, name)
    return json.load(open(path)) if os.path.exists(path) else None


PHASE_COLORS = ["#8da0cb", "#66c2a5", "#fc8d62", "#a6d854"]


def stack_phases(ax, bars, phases):
    """Stacked bars of the median phases; bars = [(label, candidate JSON)]; returns each bar's top."""
    bottom = [0.0] * len(bars)
    for (key, label), color in zip(phases, PHASE_COLORS):
        vals = [c["median_ms"][key] for _, c in bars]
        ax.bar([n for n, _ in bars], vals, bottom=bottom, color=color, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    return bottom


def save(fig, name):
    fig.tight_layout()
    out = os.path.join(DOCS, name)
    fig.savefig(out, dpi=110)
    print("wrote", out)


def ratio_bars(runs):
    fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 4.6), squeeze=False)
    phases = [("fwd", "forward"), ("bwd", "backward (Reducer: + its comm wait)"), ("sync", "exposed sync"),
              ("opt", "optimizer")]
    for ax, (title, data) in zip(axes[0], runs):
        cands = data["candidates"]
        base = next(c for c in cands if c["name"] == "meshddp")["median_ms"]["total"]
        bottom = stack_phases(ax, [(c["name"], c) for c in cands], phases)
        for i, c in enumerate(cands):
            t = c["median_ms"]["total"]
            ax.text(i, max(bottom[i], t) * 1.01, f"{t:.0f} ms\n{t / base:.2f}x", ha="center", va="bottom", fontsize=8)
        ax.set_ylabel("median step time (ms); label: ratio to meshddp")
        ax.set_title(title, fontsize=10)
        ax.set_ylim(0, max(max(bottom), max(c["median_ms"]["total"] for c in cands)) * 1.22)
        ax.tick_params(axis="x", labelrotation=25, labelsize=8)
        ax.legend(fontsize=7, loc="upper left")
    save(fig, "bench_ratios.png")


def sweep_plot(sweep, cpu_model):
    rows = [c for c in sweep["candidates"] if c["name"].startswith("meshddp_")]
    rows.sort(key=lambda c: c["bucket_mb"])
    mb = [c["bucket_mb"] for c in rows]
    fig, ax = plt.subplots(figsize=(6.8, 4.4))
    ax.plot(mb, [c["median_ms"]["total"] for c in rows], "o-", label="meshddp step (measured)")
    ax.plot(mb, [c["median_ms"]["sync"] for c in rows], "s--", label="exposed sync (measured)")
    if cpu_model and "sweep" in cpu_model:
        p = cpu_model["sweep"]
        ax.plot([r["bucket_mb"] for r in p], [r["predicted_step_ms"] for r in p], "^:",
                label="step (model, free overlap)")
        ax.plot([r["bucket_mb"] for r in p], [r["predicted_step_shared_cores_ms"] for r in p], "d:",
                label="step (model, comm shares the cores)")
        ax.plot([r["bucket_mb"] for r in p], [r["predicted_exposed_ms"] for r in p], "v:",
                label="exposed (model, free overlap)")
    local = next(c for c in sweep["candidates"] if c["name"] == "local")["median_ms"]["total"]
    ax.axhline(local, color="gray", lw=1, label=f"local (no DDP) {local:.0f} ms")
    ax.axvline(40, color="red", lw=1, ls="--", label="default 40 MiB")
    ax.set_xscale("log")
    ax.set_xlabel("bucket size (MiB)")
    ax.set_ylabel("ms (median)")
    ax.set_title(f"bucket-size sweep, {sweep['world']} ranks Gloo CPU, {sweep['params'] / 1e6:.1f}M params", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    save(fig, "bench_bucket_sweep.png")


def scaling_plot(scale):
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.4))
    for zero1, style in ((False, "-"), (True, "--")):
        rs = [r for r in scale["results"] if r["zero1"] == zero1]
        dps = [r["dp"] for r in rs]
        tag = "ZeRO-1" if zero1 else "all-reduce"
        ax1.plot(dps, [r["default"]["step_ms"] for r in rs], "o" + style, label=f"{tag}, 40 MiB buckets")
        ax1.plot(dps, [r["best"]["step_ms"] for r in rs], "^" + style, label=f"{tag}, best bucket")
        ax1.plot(dps, [r["default"]["compute_ms"] for r in rs], ":", color="gray") if not zero1 else None
        ax2.plot(dps, [r["default"]["exposed_ms"] + r["default"]["gather_exposed_ms"] for r in rs], "o" + style,
                 label=f"{tag} exposed, 40 MiB")
        ax2.plot(dps, [r["best"]["exposed_ms"] + r["best"]["gather_exposed_ms"] for r in rs], "^" + style,
                 label=f"{tag} exposed, best bucket")
        for r in rs:
            ax1.annotate(f"{r['best']['bucket_mb']:g}", (r["dp"], r["best"]["step_ms"]), fontsize=7,
                         textcoords="offset points", xytext=(3, -10))
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("DP size (x TP 8 GPUs)")
    ax1.set_ylabel("predicted step time (ms)")
    ax1.set_title("7B GPT, 4M-token global batch, H100 + 400G IB (gray: compute only)", fontsize=9)
    ax1.legend(fontsize=7)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("DP size")
    ax2.set_ylabel("predicted exposed communication (ms)")
    ax2.set_title("exposed DP communication per step", fontsize=9)
    ax2.legend(fontsize=7)
    save(fig, "bench_scaling.png")


def before_after_phases(panels):
    """Issue 14: per candidate, the phases before (the binary of main before the change, run just before)
    and after (this build), side by side; panels = [(title, before_json, after_json)]."""
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 4.8), squeeze=False)
    phases = [("fwd", "forward"), ("bwd", "backward (Reducer: + its comm wait)"), ("sync", "exposed comm"),
              ("opt", "optimizer (ZeRO-1: + param all-gather)")]
    for ax, (title, before, after) in zip(axes[0], panels):
        bars = []
        for c in after["candidates"]:
            old = next((b for b in before["candidates"] if b["name"] == c["name"]), None) if before else None
            if old is not None:
                bars.append((c["name"] + "\nbefore", old))
            bars.append((c["name"] + ("\nafter" if old is not None else ""), c))
        bottom = stack_phases(ax, bars, phases)
        for i, (_, c) in enumerate(bars):
            t = c["median_ms"]["total"]
            ax.text(i, max(bottom[i], t) * 1.01, f"{t:.0f}", ha="center", va="bottom", fontsize=7)
        ax.set_ylabel("median step time (ms), stacked: median phases")
        ax.set_title(title, fontsize=9)
        ax.set_ylim(0, max(max(bottom), max(c["median_ms"]["total"] for _, c in bars)) * 1.15)
        ax.tick_params(axis="x", labelrotation=60, labelsize=7)
        ax.legend(fontsize=7, loc="upper left")
    save(fig, "bench_grad_in_buffer_phases.png")


def main():
    runs = []
    for name, title in (("main_2ranks.json", "2 ranks, Gloo, 1 thread each"), ("main_1rank.json", "1 rank, 2 threads")):
        d = load(name)
        if d:
            runs.append((f"{title}: {d['params'] / 1e6:.1f}M-param MLP, {d['optimizer']}", d))
    if runs:
        ratio_bars(runs)
    sweep = load("sweep_2ranks.json")
    if sweep:
        sweep_plot(sweep, load("cost_model_cpu.json"))
    scale = load("cost_model_scale.json")
    if scale:
        scaling_plot(scale)
    panels = []
    for world, title in ((1, "1 rank, 2 threads"), (2, "2 ranks, Gloo, 1 thread each")):
        after = load(f"grad_in_buffer_{world}rank{'s' if world > 1 else ''}_after.json")
        if after:
            panels.append((f"{title}: before / after gradients in the buffer", load(f"grad_in_buffer_{world}rank{'s' if world > 1 else ''}_before.json"), after))
    if panels:
        before_after_phases(panels)


if __name__ == "__main__":
    sys.exit(main())
