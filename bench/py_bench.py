"""meshddp's Python DDP against torch.nn.parallel.DistributedDataParallel, side by side in one run
on the same ~25M-param model (24 Linear(1024, 1024) + ReLU, batch 32 per rank), data and ranks,
with bench/ddp_bench.cpp's method: warm-up, then N repetitions in which every candidate takes one
step, the order rotating every repetition, a barrier before each step; per step the max over ranks;
medians. Every candidate steps torch.optim.SGD (momentum 0.9) on its own copy of the model.

  local          the model trained in this rank alone, no DDP (the floor)
  meshddp        meshddp.DistributedDataParallel (C++ hooks, 40 MB buckets overlapped with backward)
  torch_ddp      torch DDP, default settings (gradient_as_bucket_view=False: grads copied to buckets)
  torch_ddp_view torch DDP with gradient_as_bucket_view=True

Gradient memory: bytes held for gradients and their communication buffers (meshddp: the flat
buffer, the grads are views of it; torch DDP: the .grad tensors plus the Reducer's buckets, or the
buckets alone with gradient_as_bucket_view).

  .venv/bin/torchrun --standalone --nproc-per-node 2 bench/py_bench.py [--reps 10] [--json out.json]
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import meshddp


def make_model(layers, hidden):
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods)


def grad_memory(name, wrapped, model):
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if name == "meshddp":
        return wrapped.grad_buffer_bytes()
    if name == "torch_ddp":
        return 2 * param_bytes  # .grad tensors + the Reducer's buckets (every param is in one)
    return param_bytes  # local: .grad only; torch_ddp_view: the buckets (grads are views of them)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--candidates", default="local,meshddp,torch_ddp,torch_ddp_view")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo")

    candidates = []
    for name in args.candidates.split(","):
        model = make_model(args.layers, args.hidden)
        if name == "local":
            wrapped = model
        elif name == "meshddp":
            wrapped = meshddp.DistributedDataParallel(model, process_group=group,
                                                      config=meshddp.DdpConfig(bucket_bytes=40 << 20))
        elif name in ("torch_ddp", "torch_ddp_view"):
            wrapped = torch.nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=40,
                                                                gradient_as_bucket_view=name == "torch_ddp_view")
        else:
            raise SystemExit(f"unknown candidate {name}")
        opt = torch.optim.SGD(wrapped.parameters(), lr=1e-3, momentum=0.9)
        candidates.append((name, model, wrapped, opt))

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.hidden, generator=g)
    y = torch.randn(args.batch, args.hidden, generator=g)

    def step(name, wrapped, opt):
        if name == "meshddp":
            wrapped.zero_grad_buffer()
        else:
            opt.zero_grad(set_to_none=False)
        F.mse_loss(wrapped(x), y).backward()
        if name == "meshddp":
            wrapped.finish_grad_sync()
        opt.step()

    times = {name: [] for name, *_ in candidates}
    for rep in range(args.warmup + args.reps):
        shift = rep % len(candidates)
        for name, _, wrapped, opt in candidates[shift:] + candidates[:shift]:
            dist.barrier(group)
            start = time.perf_counter()
            step(name, wrapped, opt)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
            if rep >= args.warmup:
                times[name].append(elapsed.item() * 1e3)

    if rank == 0:
        params = sum(p.numel() for p in candidates[0][1].parameters())
        with open("/proc/loadavg") as f:
            load = f.read().split()[:3]
        result = {"ranks": world, "params": params, "batch_per_rank": args.batch, "reps": args.reps,
                  "loadavg_at_end": load, "candidates": {}}
        print(f"# py_bench: {world} ranks, {params / 1e6:.1f}M params, batch {args.batch}/rank, {args.reps} reps, "
              f"load {' '.join(load)}")
        print(f"{'candidate':16s} {'median ms':>10s} {'min ms':>8s} {'grad MB':>8s}")
        for name, model, wrapped, _ in candidates:
            med = statistics.median(times[name])
            mem = grad_memory(name, wrapped, model)
            result["candidates"][name] = {"median_ms": med, "step_ms": times[name], "grad_bytes": mem}
            print(f"{name:16s} {med:10.1f} {min(times[name]):8.1f} {mem / 1e6:8.1f}")
        if "meshddp" in times:
            for ref in ("torch_ddp", "torch_ddp_view"):
                if ref in times:
                    ratio = statistics.median(times["meshddp"]) / statistics.median(times[ref])
                    result[f"ratio_meshddp_over_{ref}"] = ratio
                    print(f"ratio meshddp / {ref}: {ratio:.3f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
