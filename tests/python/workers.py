"""Per-rank bodies of the multi-rank Python tests (run by multiprocess.run in spawned processes).
Each returns plain numbers/tensors that the test asserts on in the parent."""

import contextlib
import copy
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import meshddp

STEPS = 10
BATCH = 4  # per rank and micro-batch


class Net(torch.nn.Module):
    """An MLP; `unused` adds a branch forward never runs, `tied` a layer sharing `hidden`'s weight."""

    def __init__(self, unused=False, tied=False):
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.hidden = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 8)
        self.branch = torch.nn.Linear(16, 16) if unused else None
        self.hidden2 = None
        self.grads_in_buffer = False  # True: the layers run meshddp.linear_with_grad_in_buffer (same math)
        if tied:
            self.hidden2 = torch.nn.Linear(16, 16, bias=False)
            self.hidden2.weight = self.hidden.weight  # the same Parameter in two modules

    def linear(self, layer, x):
        if self.grads_in_buffer:
            return meshddp.linear_with_grad_in_buffer(x, layer.weight, layer.bias)
        return layer(x)

    def forward(self, x):
        h = torch.tanh(self.linear(self.embed, x))
        h = torch.tanh(self.linear(self.hidden, h))
        if self.hidden2 is not None:
            h = torch.tanh(self.linear(self.hidden2, h))
        return self.linear(self.out, h)


def batch(step, rank, micro, dim_in=8, dim_out=8):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(BATCH, dim_in, generator=g), torch.randn(BATCH, dim_out, generator=g)


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def grads_of(model):
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def make_optimizer(kind, params, weight_decay):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=weight_decay)


def vs_torch_ddp(rank, world_size, variant, optimizer, device="cpu"):
    """meshddp's DDP and torch's DDP on the same model and data: the gradients after the first
    step's backward, and the params after STEPS optimizer steps. variant: plain | accumulate
    (2 micro-batches, no_sync) | unused (a branch no forward reaches) | tied (a shared weight) |
    in_buffer (accumulate, with our model's layers writing their gradients into the flat buffer).
    device: where the model and data live (cuda: every rank on the one GPU, Gloo with CUDA tensors)."""
    torch.manual_seed(0)
    model = Net(unused=variant == "unused", tied=variant == "tied").to(device)
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=variant == "unused")
    model.grads_in_buffer = variant == "in_buffer"
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    config = meshddp.DdpConfig(bucket_bytes=1024, find_unused_parameters=variant == "unused")
    ours = meshddp.DistributedDataParallel(model, mesh, "dp", config)
    weight_decay = 0.0 if variant == "unused" else 0.01  # torch skips None grads; ours are zeros
    opt_ref = make_optimizer(optimizer, ref.parameters(), weight_decay)
    opt_ours = make_optimizer(optimizer, ours.parameters(), weight_decay)
    micro = 2 if variant in ("accumulate", "in_buffer") else 1
    grad_diff = None
    written_in_place = []
    for step in range(STEPS):
        opt_ref.zero_grad()
        ours.zero_grad_buffer()
        for m in range(micro):
            x, y = (t.to(device) for t in batch(step, rank, m))
            last = m == micro - 1
            with contextlib.nullcontext() if last else ref.no_sync():
                (F.mse_loss(ref(x), y) / micro).backward()
            with contextlib.nullcontext() if last else ours.no_sync():
                (F.mse_loss(ours(x), y) / micro).backward()
        ours.finish_grad_sync()
        written_in_place.append(ours._engine.grads_written_in_place())
        if step == 0:
            grad_diff = max_diff(grads_of(ref.module), grads_of(ours.module))
            grad_scale = max(g.abs().max().item() for g in grads_of(ref.module))
        opt_ref.step()
        opt_ours.step()
    names = [n for n, _ in ours.named_parameters()]
    return {
        "grad_diff": grad_diff,
        "grad_scale": grad_scale,
        "param_diff": max_diff(list(ref.module.parameters()), list(ours.parameters())),
        "names": names,
        "num_buckets": ours._engine.num_buckets(),
        "launched_by_hooks": ours._engine.buckets_launched_by_hooks(),
        "written_in_place": written_in_place,
        "hidden2_is_hidden": variant != "tied" or ours.module.hidden2.weight is ours.module.hidden.weight,
    }


def zero1_vs_adamw(rank, world_size, checkpoint_dir, device="cpu"):
    """ZeRO-1 from Python (meshddp.DistributedOptimizer, AdamW) against torch.optim.AdamW in one
    process on the global batch (every rank computes the golden itself); then a checkpoint saved
    from Python and loaded into a freshly built model and optimizer."""
    torch.manual_seed(0)
    model = Net().to(device)
    golden = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    ddp = meshddp.DistributedDataParallel(model, mesh, config=meshddp.DdpConfig(bucket_bytes=1024,
                                                                                 use_distributed_optimizer=True))
    opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="adamw", lr=0.01, weight_decay=0.01))
    opt_golden = torch.optim.AdamW(golden.parameters(), lr=0.01, weight_decay=0.01, foreach=False)
    results = []
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        x, y = (t.to(device) for t in batch(step, rank, 0))
        F.mse_loss(ddp(x), y).backward()
        results.append(opt.step())
        xs, ys = zip(*((t.to(device) for t in batch(step, r, 0)) for r in range(world_size)))
        opt_golden.zero_grad()
        F.mse_loss(golden(torch.cat(xs)), torch.cat(ys)).backward()
        opt_golden.step()
        if step in (3, 6):
            opt.save_checkpoint(checkpoint_dir)  # step-4, step-7: pruned by the last save's keep_last=2
    opt.finish_param_sync()
    opt.save_checkpoint(checkpoint_dir, keep_last=2)
    step_dirs = sorted(n for n in os.listdir(checkpoint_dir) if n.startswith("step-"))
    torch.manual_seed(1)  # other initial values, which the load must overwrite
    fresh = meshddp.DistributedDataParallel(Net().to(device), mesh, config=meshddp.DdpConfig(bucket_bytes=1024,
                                                                                 use_distributed_optimizer=True))
    fresh_opt = meshddp.DistributedOptimizer(fresh, meshddp.DistributedOptimizerConfig(kind="adamw", lr=0.01, weight_decay=0.01))
    fresh_opt.load_checkpoint(checkpoint_dir)
    return {
        "reloaded_diff": max_diff(list(ddp.parameters()), list(fresh.parameters())),
        "param_diff": max_diff(list(golden.parameters()), list(ddp.parameters())),
        "skipped": [r.skipped for r in results],
        "grad_norms": [r.grad_norm for r in results],
        "steps_taken": opt.steps_taken,
        "step_dirs": step_dirs,
    }


class Block(torch.nn.Module):
    """A transformer-style MLP block: LayerNorm, fc1 (column-parallel), GELU, fc2 (row-parallel), head."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 16)
        self.head = torch.nn.Linear(16, 8)

    def forward(self, x):
        h = self.norm(x)
        return self.head(h + self.fc2(F.gelu(self.fc1(h))))


def full(p):
    return p.full_tensor() if isinstance(p, DTensor) else p


def tp_vs_single(rank, world_size, dp, tp, optimizer, device="cpu"):
    """The Block parallelized with torch TP (parallelize_module over the mesh's "tp" dim) and wrapped
    in meshddp DDP on a dp x tp mesh, against the same Block at 1x1 (one process, global batch).
    optimizer: sgd | adamw (torch's, on the DTensor params) | zero1 (meshddp.DistributedOptimizer) | zero1_overlap
    (its param all-gathers overlapped with the next forward, each DTensor op waiting for its bucket) | zero2
    (the same under data_parallel_sharding_strategy='optim_grads') | zero3 ('optim_grads_params': the local
    shards of the DTensor params sharded again over DP, gathered per unit on use) | zero2_accum, zero3_accum
    (each rank's batch in 2 micro-batches, the first under no_sync). device "cuda": every rank on the one GPU
    (Gloo with CUDA tensors; tests/python/test_gpu.py)."""
    torch.manual_seed(0)
    model = Block().to(device)
    golden = copy.deepcopy(model)
    mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    zero1 = optimizer.startswith("zero")
    strategy = {"zero1": "optim", "zero2": "optim_grads", "zero3": "optim_grads_params"}.get(optimizer[:5], "no_shard")
    micro_batches = 2 if optimizer.endswith("_accum") else 1
    ddp = meshddp.DistributedDataParallel(model, mesh, "dp", meshddp.DdpConfig(
        bucket_bytes=512, data_parallel_sharding_strategy=strategy))
    if zero1:
        opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(
            kind="adamw", lr=0.01, weight_decay=0.01, overlap_param_gather=optimizer == "zero1_overlap"))
        opt_golden = torch.optim.AdamW(golden.parameters(), lr=0.01, weight_decay=0.01, foreach=False)
    else:
        opt = make_optimizer(optimizer, ddp.parameters(), 0.01)
        opt_golden = make_optimizer(optimizer, golden.parameters(), 0.01)
    dp_rank = mesh.get_local_rank("dp")
    grad_diff = None
    grads_seen = False  # any param's .grad set after a backward (optim_grads keeps none)
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        x, y = (t.to(device) for t in batch(step, dp_rank, 0, 16, 8))
        for m, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
            ddp.set_requires_gradient_sync(m == micro_batches - 1)
            (F.mse_loss(ddp(xm), ym) / micro_batches).backward()
            grads_seen = grads_seen or any(p.grad is not None for p in ddp.parameters())
        ddp.finish_grad_sync()
        xs, ys = zip(*(batch(step, r, 0, 16, 8) for r in range(dp)))
        opt_golden.zero_grad()
        F.mse_loss(golden(torch.cat(xs).to(device)), torch.cat(ys).to(device)).backward()
        if step == 0 and not zero1:  # with ZeRO-1 only this rank's shard of each bucket is synced
            grad_diff = max_diff([full(p.grad) for p in ddp.parameters()], [p.grad for p in golden.parameters()])
        opt.step()
        opt_golden.step()
    if zero1:
        opt.finish_param_sync()
    out = {"grads_seen": grads_seen, "grad_diff": grad_diff, "grad_bytes": ddp.grad_buffer_bytes(),
           "dtensor_params": sorted(n for n, p in ddp.named_parameters() if isinstance(p, DTensor))}
    if strategy == "optim_grads_params":  # the params hold only shards: read through the collective state_dict()
        local_bytes = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in ddp.module.parameters())
        out["param_bytes"] = (ddp.param_storage_bytes(), ddp.param_shard_bytes(), local_bytes)
        state = ddp.state_dict()
        params = [full(state[name]) for name, _ in ddp.module.named_parameters()]
        out["dtensors_in_state_dict"] = sorted(k for k, v in state.items() if isinstance(v, DTensor))
        ddp.load_state_dict(state)  # DTensor values: each rank writes the DP shards of its own TP shard
        reloaded = ddp.state_dict()
        ddp.load_state_dict({k: full(v) for k, v in state.items()})  # whole tensors: each rank cuts its TP shard
        out["reloaded_equal"] = all(full(a).equal(full(b)) for s in (reloaded, ddp.state_dict())
                                    for a, b in zip(s.values(), state.values()))
    else:
        params = [full(p) for p in ddp.parameters()]
    out["param_diff"] = max_diff(params, list(golden.parameters()))
    out["params"] = [p.detach().clone() for p in params]
    return out


def ddp_suite(rank, world_size, checkpoint_dir):
    """Every vs_torch_ddp case and zero1_vs_adamw in one launch (process start-up dominates)."""
    out = {(v, o): vs_torch_ddp(rank, world_size, v, o)
           for v in ("plain", "accumulate", "unused", "tied", "in_buffer") for o in ("sgd", "adamw")}
    out["zero1"] = zero1_vs_adamw(rank, world_size, checkpoint_dir)
    return out


def tp_wrong_mesh_error(rank, world_size, dp, tp):
    """A Block parallelized over mesh["dp"] (a 1-D mesh of the TP size, but not the TP sub-mesh):
    DistributedDataParallel's error text (before: accepted, shards averaged over DP)."""
    torch.manual_seed(0)
    model = Block()
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["dp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    try:
        meshddp.DistributedDataParallel(model, mesh, "dp")
    except RuntimeError as e:
        return str(e)
    return "(no error)"


def tp_group_checks(rank, world_size, dp, tp):
    """With the TP group handed to the engine: a replicated (plain) param that differs across ranks
    takes global rank 0's value at construction (DP, then TP broadcast), and one that drifts on TP
    rank 1 afterwards is named by the TP-replica check at the next step's forward."""
    torch.manual_seed(rank)  # every rank starts different
    model = Block()
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    ddp = meshddp.DistributedDataParallel(model, mesh, "dp", meshddp.DdpConfig(tp_replica_check_interval=1))
    head = model.head.weight.detach().clone()
    with torch.no_grad():
        if mesh.get_local_rank("tp") == 1:
            model.head.weight.add_(1.0)  # a replica drifts (e.g. an update only some TP ranks made)
    error = "(no error)"
    try:
        for step in range(2):
            ddp.zero_grad_buffer()
            x, y = batch(step, mesh.get_local_rank("dp"), 0, 16, 8)
            F.mse_loss(ddp(x), y).backward()
            ddp.finish_grad_sync()
    except RuntimeError as e:
        error = str(e)
    return {"head_after_init": head, "replica_error": error}


def tp_zero3_compile_refused(dp, tp):
    """torch.compile of a DTensor model's wrapper under optim_grads_params: the error (refused before tracing)."""
    torch.manual_seed(0)
    model = Block()
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    ddp = meshddp.DistributedDataParallel(model, mesh, "dp", meshddp.DdpConfig(
        data_parallel_sharding_strategy="optim_grads_params"))
    try:
        torch.compile(ddp, backend="eager")(torch.randn(4, 16))
    except RuntimeError as e:
        return str(e)
    return "(no error)"


def tp_zero3_load_with_a_frozen_dtensor(dp, tp):
    """optim_grads_params with a frozen DTensor param (whole on every rank, not in a unit): load_state_dict of
    whole tensors cuts each rank's TP shard of every param, the frozen one too. Returns the keys whose values
    differ from the given ones afterwards."""
    torch.manual_seed(0)
    model = Block()
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    model.fc1.weight.requires_grad_(False)
    ddp = meshddp.DistributedDataParallel(model, mesh, "dp", meshddp.DdpConfig(
        data_parallel_sharding_strategy="optim_grads_params"))
    torch.manual_seed(5)
    given = Block().state_dict()
    ddp.load_state_dict(given)
    return sorted(k for k, v in ddp.state_dict().items() if not full(v).equal(given[k]))


def tp_parallelized_after_wrapping(dp, tp):
    """parallelize_module after wrapping (the params replaced by DTensors the engine never saw): the first
    forward's error (before: under 'optim' the replaced layers never changed, silently)."""
    torch.manual_seed(0)
    model = Block()
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    ddp = meshddp.DistributedDataParallel(model, mesh, "dp", meshddp.DdpConfig(use_distributed_optimizer=True))
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    try:
        ddp(torch.randn(4, 16))
    except RuntimeError as e:
        return str(e)
    return "(no error)"


def tp_suite(rank, world_size, dp, tp):
    cases = ("sgd", "adamw", "zero1", "zero1_overlap", "zero2", "zero2_accum", "zero3", "zero3_accum")
    out = {o: tp_vs_single(rank, world_size, dp, tp, o) for o in cases}
    out["wrong_mesh"] = tp_wrong_mesh_error(rank, world_size, dp, tp)
    out["zero3_compile"] = tp_zero3_compile_refused(dp, tp)
    out["zero3_frozen_load"] = tp_zero3_load_with_a_frozen_dtensor(dp, tp)
    out["parallelized_after"] = tp_parallelized_after_wrapping(dp, tp)
    out["tp_group"] = tp_group_checks(rank, world_size, dp, tp)
    return out


def cuda_suite(rank, world_size, checkpoint_dir):
    """Some vs_torch_ddp cases and zero1_vs_adamw with the model and data on the GPU (every rank on
    the one GPU, Gloo with CUDA tensors): tests/python/test_gpu.py, on a GPU machine."""
    out = {(v, o): vs_torch_ddp(rank, world_size, v, o, device="cuda") for v, o in (("plain", "sgd"),
                                                                                  ("in_buffer", "adamw"))}
    out["zero1"] = zero1_vs_adamw(rank, world_size, checkpoint_dir, device="cuda")
    return out


def zero1_on_cuda_only_group(rank, world_size, checkpoint_dir):
    """zero1_vs_adamw on a default group whose only backend serves CUDA tensors (init_process_group
    ("cuda:gloo"), standing for "nccl"): meshddp gives it a CPU backend for its control plane."""
    before = sorted(d.type for d in dist.group.WORLD._device_types)
    out = zero1_vs_adamw(rank, world_size, checkpoint_dir)
    out["device_types_before"] = before
    out["device_types_after"] = sorted(d.type for d in dist.group.WORLD._device_types)
    return out


def noop(rank, world_size):
    return None


@contextlib.contextmanager
def captured_stderr(into):
    """Collects what this process writes to fd 2 (C++ included) into into[0]."""
    import os
    import tempfile

    with tempfile.TemporaryFile(mode="w+") as f:
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            into.append(f.read())


def a_rank_late_by_one_step(rank, world_size):
    """Rank 0 starts its second step 2 s after rank 1 (as if rank 1 ran one more step): rank 1 waits
    in that step's bucket all-reduce. With stuck_report_after=0.25 s it reports the wait on stderr,
    naming the ranks that have not launched the collective. Returns what each rank wrote to stderr."""
    import time

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    ddp = meshddp.DistributedDataParallel(Net(), mesh, config=meshddp.DdpConfig(bucket_bytes=0),
                                          stuck_report_after=0.25)
    text = []
    with captured_stderr(text):
        for step in range(2):
            if step == 1 and rank == 0:
                time.sleep(2.0)
            ddp.zero_grad_buffer()
            x, y = batch(step, rank, 0)
            F.mse_loss(ddp(x), y).backward()
            ddp.finish_grad_sync()
    return text[0]


def a_peer_dies(rank, world_size):
    """Rank world_size - 1 exits (os._exit: its sockets close, as a killed process's) at its third
    step, after the others have started it; their bucket all-reduce fails at once (Gloo: connection
    closed), well within the 5 s publish interval of the progress records. Returns each live rank's
    error text (the dead one returns nothing)."""
    import time

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    ddp = meshddp.DistributedDataParallel(Net(), mesh, config=meshddp.DdpConfig(bucket_bytes=0))
    for step in range(3):
        if step == 2 and rank == world_size - 1:
            time.sleep(0.5)  # the others are in this step's all-reduces
            os._exit(0)
        ddp.zero_grad_buffer()
        x, y = batch(step, rank, 0)
        try:
            F.mse_loss(ddp(x), y).backward()
            ddp.finish_grad_sync()
        except RuntimeError as e:
            _live_ranks_have_reported(rank, world_size - 1)
            return str(e)
    return "(no error)"


def _live_ranks_have_reported(rank, live):
    """Ranks 0 .. live-1 each mark that their error text is complete; rank 0, which hosts the
    rendezvous store, waits (up to 60 s) for every mark before it returns and its process tears the
    store down: a peer still reading the progress records would find the store gone and report rank 0's
    progress as unknown ("store unreadable")."""
    import time

    marks = os.path.join(tempfile.gettempdir(), f"meshddp_reported_{os.environ['MASTER_PORT']}")
    os.makedirs(marks, exist_ok=True)
    open(os.path.join(marks, str(rank)), "w").close()
    if rank != 0:
        return
    deadline = time.time() + 60
    while len(os.listdir(marks)) < live and time.time() < deadline:
        time.sleep(0.05)
    shutil.rmtree(marks, ignore_errors=True)


@contextlib.contextmanager
def counting_thread():
    """A Python thread that counts every 5 ms while the block runs; yields the count ([n]). While C++
    holds the GIL, it stalls: the count shows whether a wait released it."""
    import threading
    import time

    ticks, stop = [0], threading.Event()

    def count():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.005)

    thread = threading.Thread(target=count)
    thread.start()
    try:
        yield ticks
    finally:
        stop.set()
        thread.join()


def python_runs_while_forward_waits(rank, world_size):
    """Rank 0 enters its training forward 1 s after rank 1, whose forward waits in the buffer
    broadcast (broadcast_buffers) for it. Meanwhile a Python thread on rank 1 counts: with the GIL
    released in check_before_forward it keeps counting; held, it stalls for the whole second."""
    import time

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))  # buffers to broadcast
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    ddp = meshddp.DistributedDataParallel(model, mesh)
    if rank == 0:
        time.sleep(1.0)
        ddp(torch.randn(4, 8))
        return None
    with counting_thread() as ticks:
        start, before = time.monotonic(), ticks[0]
        ddp(torch.randn(4, 8))
        waited, during = time.monotonic() - start, ticks[0] - before
    return {"waited": waited, "ticks": during}


def zero1_exit_without_finish_param_sync(rank, world_size):
    """ZeRO-1 with overlapped param all-gathers; the last step's gathers are left pending: the
    optimizer is dropped without finish_param_sync(). Returns the gathers pending before and after
    (its teardown must have finished them) and the params (whole: equal on every rank)."""
    import gc

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    ddp = meshddp.DistributedDataParallel(Net(), mesh, config=meshddp.DdpConfig(bucket_bytes=512,
                                                                               use_distributed_optimizer=True))
    opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(lr=0.01, overlap_param_gather=True))
    for step in range(3):
        ddp.zero_grad_buffer()
        x, y = batch(step, rank, 0)
        F.mse_loss(ddp(x), y).backward()
        opt.step()
    pending_before = ddp._engine.pending_param_gathers()
    params = list(ddp.parameters())
    del opt
    gc.collect()
    return {"pending_before": pending_before, "pending_after": ddp._engine.pending_param_gathers(),
            "params": [p.detach().clone() for p in params]}


def python_runs_while_the_engine_is_destroyed(rank, world_size):
    """Rank 1 drops its DDP while its bucket all-reduces are in flight (rank 0 starts its backward
    1 s later): the engine's destructor waits for them. Meanwhile a Python thread on rank 1 counts:
    with the destructor run without the GIL it keeps counting; with the GIL held, it stalls."""
    import gc
    import time

    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    ddp = meshddp.DistributedDataParallel(model, mesh, config=meshddp.DdpConfig(bucket_bytes=0))
    ddp.zero_grad_buffer()
    x, y = batch(0, rank, 0)
    if rank == 0:
        time.sleep(1.0)
        F.mse_loss(ddp(x), y).backward()
        ddp.finish_grad_sync()
        return None
    F.mse_loss(ddp(x), y).backward()  # launches every bucket; they wait for rank 0
    with counting_thread() as ticks:
        start = time.monotonic()
        del ddp
        gc.collect()
        waited = time.monotonic() - start
    return {"waited": waited, "ticks": ticks[0]}


def state_dict_right_after_step(rank, world_size):
    """ZeRO-1 with overlap_param_gather, bf16: elements of ddp.state_dict() taken right after step()
    (the params' all-gathers pending) that differ from after finish_param_sync()."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    ddp = meshddp.DistributedDataParallel(model, mesh, "dp", meshddp.DdpConfig(use_distributed_optimizer=True, bucket_bytes=0))
    opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="sgd", lr=0.1, momentum=0.0, weight_decay=0.0,
                                                                    overlap_param_gather=True))
    ddp.zero_grad_buffer()
    ddp(torch.ones(2, 64, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    early = {k: v.clone() for k, v in ddp.state_dict().items()}
    opt.finish_param_sync()
    late = ddp.state_dict()
    return sum(int((early[k] != late[k]).sum()) for k in late)
