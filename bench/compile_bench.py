"""Step time and bucket overlap under torch.compile, meshddp's wrapper beside torch's DDP, 2 ranks
(Gloo, CPU, one thread each), side by side in one run: eager, the whole wrapper compiled (split at the
buckets; and with torch._dynamo.config.optimize_ddp=False, one graph), and each block compiled before
wrapping, with inductor. The model: a pre-LN MLP transformer (blocks of LayerNorm, Linear(d, 4d),
GELU, Linear(4d, d), residual), 1 MiB buckets.

    .venv/bin/python bench/compile_bench.py [--blocks 6] [--dim 256] [--tokens 512] [--steps 10] [--backend inductor]
                                            [--warm-caches]

Prints per setting: the median step time over the timed steps (the slower rank's), its ratio to
meshddp eager and to torch's DDP in the same setting, and the overlap: the Gloo all-reduces started
before the backward's last compute op ended (torch.profiler, one step after the timed ones), of all
bucket launches; the warm-up (the first 3 steps: compiles), each setting compiling into empty inductor
caches after a start-up compile run before all settings. Not a test: CI does not run it."""

import argparse
import atexit
import datetime
import os
import shutil
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

SETTINGS = [  # (name, wrapper, how it is compiled)
    ("eager", "meshddp", None), ("eager", "torch", None),
    ("compiled", "meshddp", "whole"), ("compiled", "torch", "whole"),
    ("compiled, one graph", "meshddp", "whole_unsplit"), ("compiled, one graph", "torch", "whole_unsplit"),
    ("per-block compiled", "meshddp", "per_block"), ("per-block compiled", "torch", "per_block"),
]
BUCKET_BYTES = 1 << 20


class Block(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(torch.nn.Module):
    def __init__(self, blocks, dim):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Block(dim) for _ in range(blocks))
        self.head = torch.nn.Linear(dim, dim)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _overlap(prof):
    end, starts = 0.0, []
    for e in prof.events():
        if e.name.startswith("autograd::engine::evaluate_function:") and "AccumulateGrad" not in e.name:
            end = max(end, e.time_range.end)
        elif e.name == "c10d::allreduce_":  # the launch (gloo:all_reduce: when a Gloo thread starts it)
            starts.append(e.time_range.start)
    return sum(s < end for s in starts), len(starts)


def _cold_inductor_caches(rank, setting_index):
    """Each setting compiles into an empty inductor cache (its own cache dir, no FX graph cache, no
    in-memory compiled modules or C++ kernels): otherwise a later setting's sections, the same graphs as an earlier
    setting's (torch's DDP compiled after meshddp's), load from that setting's cache, and its warm-up
    measures a cache hit, not a compile."""
    cache_dir = tempfile.mkdtemp(prefix=f"compile_bench_r{rank}_s{setting_index}_")
    atexit.register(shutil.rmtree, cache_dir, True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    torch._inductor.config.fx_graph_cache = False
    from torch._inductor import codecache

    codecache.PyCodeCache.cache_clear()
    for cpp_cache in (codecache.CppCodeCache, codecache.CppPythonBindingsCodeCache, codecache.CppWrapperCodeCache):
        cpp_cache.cache.clear()  # the compiled kernels, by source: a later setting's equal kernels would load them


def _inductor_start_up(backend):
    """One tiny compile before the settings: inductor's one-off start-up (its imports, the C++ compiler's
    checks), which would otherwise count in the first compiled setting's warm-up."""
    if backend == "inductor":
        torch.compile(lambda t: torch.nn.functional.gelu(t) * 2, backend=backend)(torch.randn(4, requires_grad=True)).sum().backward()


def _run_setting(args, rank, wrapper, how, setting_index=0):
    import meshddp

    if args.backend == "inductor" and not args.warm_caches:
        _cold_inductor_caches(rank, setting_index)
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = how != "whole_unsplit"
    model = Model(args.blocks, args.dim)
    if how == "per_block":
        for block in model.blocks:
            block.compile(backend=args.backend)
    if wrapper == "torch":
        ddp = TorchDDP(model, bucket_cap_mb=BUCKET_BYTES / 2**20)
    else:
        config = meshddp.DdpConfig()
        config.bucket_bytes = BUCKET_BYTES
        ddp = meshddp.DistributedDataParallel(model, process_group=dist.group.WORLD, config=config)
    run = torch.compile(ddp, backend=args.backend) if how in ("whole", "whole_unsplit") else ddp
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.tokens, args.dim, generator=g), torch.randn(args.tokens, args.dim, generator=g)

    def step():
        if wrapper == "torch":
            opt.zero_grad()
        else:
            ddp.zero_grad_buffer()
        F.mse_loss(run(x), y).backward()
        if wrapper != "torch":
            ddp.finish_grad_sync()
        opt.step()

    compile_start = time.perf_counter()
    for _ in range(3):  # warm-up: compiles, and torch's DDP rebuilds its buckets after the first step
        step()
    warmup = time.perf_counter() - compile_start
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    before, launches = _overlap(prof)
    return statistics.median(times), before, launches, warmup


def _entry(rank, args, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=1800))
    _inductor_start_up(args.backend)
    results = [_run_setting(args, rank, wrapper, how, i) for i, (_, wrapper, how) in enumerate(SETTINGS)]
    torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--warm-caches", action="store_true",
                        help="let settings share inductor's caches (warm-ups then depend on the settings' order)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"torch {torch.__version__}; {args}; load average before: {os.getloadavg()} (cores: {os.cpu_count()})")
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_entry, args=(args, port, out_dir), nprocs=2, start_method="spawn", join=True)
        per_rank = [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(2)]
    print(f"load average after: {os.getloadavg()}")
    rows = {}
    for i, (name, wrapper, _) in enumerate(SETTINGS):
        step_s = max(per_rank[r][i][0] for r in range(2))
        before = min(per_rank[r][i][1] for r in range(2))
        launches = per_rank[0][i][2]
        warmup = max(per_rank[r][i][3] for r in range(2))
        rows[(name, wrapper)] = (step_s, before, launches, warmup)
    eager = rows[("eager", "meshddp")][0]
    print("| setting | wrapper | step (ms) | vs meshddp eager | meshddp / torch | all-reduces started before the "
          "backward ended | warm-up (3 steps, s) |")
    print("|---|---|---|---|---|---|---|")
    for name, wrapper, _ in SETTINGS:
        step_s, before, launches, warmup = rows[(name, wrapper)]
        torch_step = rows[(name, "torch")][0]
        versus = f"{step_s / torch_step:.3f}" if wrapper == "meshddp" else ""
        print(f"| {name} | {wrapper} | {1e3 * step_s:.1f} | {step_s / eager:.3f} | {versus} | {before} of {launches} | "
              f"{warmup:.1f} |")


if __name__ == "__main__":
    main()
