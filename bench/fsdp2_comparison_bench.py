"""meshddp's sharding strategies against torch FSDP2 (fully_shard per transformer block, then the root) on
the same model, side by side in one run: example 03's GPT (plain PyTorch, the shape of example 02's:
token and position embeddings, pre-LN blocks, an LM head tied to the embedding), fp32, AdamW, at dp N on
CPU (Gloo) under torchrun. Each implementation runs in its own torchrun launch (so one's peak RSS is not
another's); every rank reports its peak RSS (getrusage), the gradient and param storage it holds after
the last step, and the step times. Prints one markdown table with the ratios to FSDP2.

  python bench/fsdp2_comparison_bench.py [--nproc 4] [--steps 6] [--impls optim,optim_grads,optim_grads_params,fsdp2]
         [--layers 2 --dim 64 --heads 4 --seq-len 16 --vocab 64 --global-batch 16 --bucket-mb 4]

Implementations: meshddp.DistributedDataParallel with data_parallel_sharding_strategy = optim (ZeRO-1),
optim_grads (ZeRO-2) and optim_grads_params (ZeRO-3: params sharded in per-unit buckets, each transformer
block a unit, gathered on use; its params column adds the peak held during the steps), each stepped by
meshddp.DistributedOptimizer; fsdp2 = torch.distributed.fsdp.fully_shard on every block and on the root,
torch.optim.AdamW on its DTensor shards. ~100M params: --layers 16 --dim 768 --heads 12 (113M with the
default vocab and sequence; docs/benchmarks.md). Step time: the mean over the steps after the first (the
first allocates). Not a timed test: the numbers depend on the machine and its load, printed with them."""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

IMPLS = ("optim", "optim_grads", "optim_grads_params", "fsdp2")


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--bucket-mb", type=float, default=4.0, help="meshddp's bucket_bytes, in MiB")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)  # set by the launcher
    args = parser.parse_args(argv)
    unknown = set(args.impls.split(",")) - set(IMPLS)
    if unknown:
        parser.error(f"--impls: unknown {sorted(unknown)}; from {', '.join(IMPLS)}")
    return args


def load_example_gpt():
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "03_python_gpt", "train.py")
    spec = importlib.util.spec_from_file_location("example_03_train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def local_bytes(tensors):
    """Bytes of the tensors' local storage (a DTensor's shard), each storage once."""
    import torch
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        local = t._local_tensor if isinstance(t, DTensor) else t
        key = local.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += local.untyped_storage().nbytes()
    return total


def worker(args):
    """One rank: builds the model under args.worker, trains args.steps steps, prints one JSON line."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    example = load_example_gpt()
    torch.manual_seed(1)
    model = example.Gpt(vocab=args.vocab, seq_len=args.seq_len, dim=args.dim, heads=args.heads, layers=args.layers)
    num_params = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    impl = args.worker
    report = {"rank": rank, "impl": impl, "params": num_params}
    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        run = model
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    else:
        import meshddp

        config = meshddp.DdpConfig(bucket_bytes=int(args.bucket_mb * 2**20), data_parallel_sharding_strategy=impl)
        run = meshddp.DistributedDataParallel(model, mesh, "dp", config)
        optimizer = meshddp.DistributedOptimizer(run, meshddp.DistributedOptimizerConfig(kind="adamw", lr=args.lr))
    local = args.global_batch // world
    times, losses = [], []
    for step in range(args.steps):
        start = time.perf_counter()
        ids, targets = example.make_batch(args.vocab, args.seq_len, 1, step, args.global_batch)
        ids, targets = ids[rank * local:(rank + 1) * local], targets[rank * local:(rank + 1) * local]
        if impl == "fsdp2":
            optimizer.zero_grad(set_to_none=False)
        else:
            run.zero_grad_buffer()
        logits = run(ids)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    if impl == "fsdp2":
        report["grad_bytes"] = local_bytes(p.grad for p in model.parameters())
        report["param_bytes"] = local_bytes(model.parameters())
        report["optimizer_bytes"] = local_bytes(t for s in optimizer.state.values() for t in s.values()
                                                if isinstance(t, torch.Tensor) and t.dim() > 0)
    else:
        optimizer.finish_param_sync()
        memory = optimizer.memory()
        report["grad_bytes"] = run.grad_buffer_bytes()
        # Under optim_grads_params the params' storages have bytes only while their unit is in use: the engine
        # counts what it holds (after the step: the shards) and the most it held during the steps.
        report["param_bytes"] = run.param_storage_bytes()
        report["peak_param_bytes"] = run.peak_param_storage_bytes()
        report["optimizer_bytes"] = memory["optimizer_state_bytes"] + memory["master_weight_bytes"]
    report["peak_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report["step_ms"] = 1e3 * statistics.mean(times[1:] if len(times) > 1 else times)
    report["last_loss"] = losses[-1]
    # One write (print writes the end of line apart): the ranks share the pipe, and two reports on one line
    # were seen.
    sys.stdout.write("BENCH " + json.dumps(report) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


def launch(args, impl, argv):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    # The flags travel in the environment: torchrun would take an abbreviation of its own (--nproc) for its own.
    cmd = [torchrun, "--standalone", f"--nproc-per-node={args.nproc}", os.path.abspath(__file__)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                         env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                                  MESHDDP_BENCH_WORKER=json.dumps([*argv, "--worker", impl])))
    reports = [json.loads(line[6:]) for line in out.stdout.splitlines() if line.startswith("BENCH ")]
    if out.returncode != 0 or len(reports) != args.nproc:
        sys.exit(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-4000:]}")
    return sorted(reports, key=lambda r: r["rank"])


def mb(values):
    return ", ".join(f"{v / 1e6:.1f}" for v in values)


def main(argv):
    args = parse(argv)
    if args.worker:
        return worker(args)
    model_flags = list(argv)
    print(f"command: python bench/fsdp2_comparison_bench.py {' '.join(model_flags)}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}, {os.cpu_count()} cores")
    results = {impl: launch(args, impl, model_flags) for impl in args.impls.split(",")}
    fsdp2 = results.get("fsdp2")
    base_rss = max(r["peak_rss_kib"] for r in fsdp2) if fsdp2 else None
    base_ms = statistics.mean(r["step_ms"] for r in fsdp2) if fsdp2 else None
    first = next(iter(results.values()))[0]
    print(f"model: {first['params'] / 1e6:.2f}M fp32 params, dp {args.nproc}, AdamW, {args.steps} steps; "
          f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print()
    print("| implementation | grads per rank (MB) | params per rank (MB) | optimizer state per rank (MB) | "
          "peak RSS per rank (MB) | max RSS / FSDP2's | mean step time (ms) | step time / FSDP2's | last loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for impl, reports in results.items():
        rss = [r["peak_rss_kib"] * 1024 for r in reports]
        ms = statistics.mean(r["step_ms"] for r in reports)
        rss_ratio = f"{max(rss) / (base_rss * 1024):.2f}" if base_rss else "-"
        ms_ratio = f"{ms / base_ms:.2f}" if base_ms else "-"
        peak = sorted({r["peak_param_bytes"] for r in reports if r.get("peak_param_bytes", 0) > r["param_bytes"]})
        print(f"| {impl} | {mb(sorted({r['grad_bytes'] for r in reports}))} | "
              f"{mb(sorted({r['param_bytes'] for r in reports}))}{f' (peak {mb(peak)})' if peak else ''} | "
              f"{mb(sorted({r['optimizer_bytes'] for r in reports}))} | {mb(rss)} | {rss_ratio} | {ms:.1f} | "
              f"{ms_ratio} | {reports[0]['last_loss']:.6f} |")


if __name__ == "__main__":
    main(json.loads(os.environ["MESHDDP_BENCH_WORKER"]) if "MESHDDP_BENCH_WORKER" in os.environ else sys.argv[1:])
