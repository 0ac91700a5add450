"""Construction cost: meshddp.DistributedDataParallel against torch.nn.parallel.DistributedDataParallel,
side by side on the same model (`--layers` x Linear(hidden, hidden), no bias), same ranks, Gloo on CPU.

Each repetition builds a fresh model per candidate (params filled with the rank, so the broadcast from
rank 0 has work to do; pages resident before the clock starts), then times the wrapper's constructor
alone: a barrier, the constructor, the max over ranks. The order of the candidates rotates every
repetition; medians are reported. Both use 40 MB buckets and broadcast the params from rank 0.

Peak memory: before each constructor the kernel's peak-RSS mark is reset (`echo 5 >
/proc/self/clear_refs`); after it, VmHWM - VmRSS(before) is what construction added at its peak, shown
next to the budget "grad buffer + one bucket" (the params are resident already: the budget on the
whole process is params + grad buffer + one bucket). torch DDP allocates its buckets with
torch.empty, so most of its bucket pages are touched only by the first backward.

  .venv/bin/torchrun --standalone --nproc-per-node 2 bench/construction_bench.py \
      --layers 8 --hidden 4096 --reps 3 [--dtype bfloat16] [--json out.json]
"""

import argparse
import gc
import json
import statistics
import time

import torch
import torch.distributed as dist

import meshddp

BUCKET_BYTES = 40 << 20


def status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def make_model(layers, hidden, dtype, rank):
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden, bias=False) for _ in range(layers)])
    model = model.to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5 + rank)  # differs across ranks: the broadcast from rank 0 is real work
    return model


def construct(name, model, group):
    if name == "meshddp":
        return meshddp.DistributedDataParallel(model, process_group=group,
                                               config=meshddp.DdpConfig(bucket_bytes=BUCKET_BYTES))
    if name == "torch_ddp":
        return torch.nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=BUCKET_BYTES >> 20)
    raise SystemExit(f"unknown candidate {name}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--candidates", default="meshddp,torch_ddp")
    parser.add_argument("--json")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo")
    dtype = getattr(torch, args.dtype)
    names = args.candidates.split(",")
    times = {n: [] for n in names}
    added = {n: [] for n in names}
    params = 0
    for rep in range(args.reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            model = make_model(args.layers, args.hidden, dtype, rank)
            params = sum(p.numel() for p in model.parameters())
            gc.collect()
            dist.barrier(group)
            before_kb = status_kb("VmRSS")
            reset_peak_rss()
            start = time.perf_counter()
            wrapped = construct(name, model, group)
            elapsed = time.perf_counter() - start
            peak_kb = status_kb("VmHWM")
            stats = torch.tensor([elapsed, (peak_kb - before_kb) * 1024.0], dtype=torch.float64)
            dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
            times[name].append(stats[0].item())
            added[name].append(stats[1].item())
            with torch.no_grad():
                assert all(p.flatten()[0].item() == 0.5 for p in model.parameters()), "params not broadcast"
            del wrapped
            for p in model.parameters():
                p.grad = None
            del model
            gc.collect()

    if rank == 0:
        element = torch.empty((), dtype=dtype).element_size()
        grad_bytes = params * element
        budget = grad_bytes + min(BUCKET_BYTES, grad_bytes)
        with open("/proc/loadavg") as f:
            load = f.read().split()[:3]
        result = {"ranks": world, "params": params, "dtype": args.dtype, "reps": args.reps, "loadavg_at_end": load,
                  "param_bytes": grad_bytes, "budget_added_bytes": budget, "candidates": {}}
        print(f"# construction_bench: {world} ranks, {params / 1e6:.1f}M params ({args.dtype}, "
              f"{grad_bytes / 1e6:.0f} MB) per rank, {args.reps} reps, load {' '.join(load)}")
        print(f"{'candidate':12s} {'median s':>9s} {'min s':>7s} {'peak added MB':>14s} {'budget MB':>10s}")
        for name in names:
            med = statistics.median(times[name])
            peak = max(added[name])
            result["candidates"][name] = {"median_s": med, "times_s": times[name], "peak_added_bytes": added[name]}
            print(f"{name:12s} {med:9.3f} {min(times[name]):7.3f} {peak / 1e6:14.0f} {budget / 1e6:10.0f}")
        if "meshddp" in times and "torch_ddp" in times:
            ratio = statistics.median(times["meshddp"]) / statistics.median(times["torch_ddp"])
            result["ratio_meshddp_over_torch_ddp"] = ratio
            print(f"ratio meshddp / torch_ddp: {ratio:.3f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
