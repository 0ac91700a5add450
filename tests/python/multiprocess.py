"""Runs a function of tests/python/workers.py (or of another module there: "module.function") on N local ranks (spawned processes, Gloo, CPU) and
returns each rank's result. A rank that fails fails the run with its traceback; collectives time
out after 120 s instead of hanging."""

import datetime
import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn_name, out_dir, backend, kwargs):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import importlib

    module_name, _, fn_name = fn_name.rpartition(".")
    module = importlib.import_module(module_name or "workers")

    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        result = getattr(module, fn_name)(rank, world_size, **kwargs)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run(world_size, fn_name, _backend="gloo", **kwargs):
    """Results of workers.<fn_name>(rank, world_size, **kwargs) on every rank, in rank order, with
    torch.distributed's default group made by init_process_group(_backend)."""
    # A forkserver that has imported torch, meshddp and the workers once: each rank is a fork of it
    # (~0.1 s) instead of a fresh interpreter importing torch (~5-9 s per rank on a loaded 2-core box).
    # The server never computes or communicates, so forking it is safe.
    mp.set_forkserver_preload(["torch", "torch.distributed", "meshddp", "workers"])
    with tempfile.TemporaryDirectory() as out_dir:
        # The free port is found, then released before rank 0 listens on it: another process on the machine
        # may take it in between (EADDRINUSE in init_process_group, before any work), so that alone is
        # retried with another port.
        for attempt in range(3):
            try:
                mp.start_processes(_entry, args=(world_size, _free_port(), fn_name, out_dir, _backend, kwargs),
                                   nprocs=world_size, start_method="forkserver", join=True)
                break
            except Exception as e:
                if "EADDRINUSE" in str(e) and attempt < 2:
                    for f in os.listdir(out_dir):
                        os.remove(os.path.join(out_dir, f))
                    continue
                errors = [open(os.path.join(out_dir, f)).read() for f in sorted(os.listdir(out_dir)) if f.endswith(".err")]
                raise AssertionError(f"{fn_name} on {world_size} ranks failed:\n" + "\n".join(errors)) from e
        # A rank that ended itself with os._exit(0) (a peer dying on purpose) has no result: None.
        paths = [os.path.join(out_dir, f"{r}.pt") for r in range(world_size)]
        return [torch.load(p, weights_only=False) if os.path.exists(p) else None for p in paths]


_runs = {}


def run_once(world_size, fn_name, **kwargs):
    """run(), memoized per arguments, failures included (tests that share one launch fail together
    with the same message instead of relaunching)."""
    key = (world_size, fn_name, tuple(sorted(kwargs.items())))
    if key not in _runs:
        try:
            _runs[key] = (run(world_size, fn_name, **kwargs), None)
        except AssertionError as e:
            _runs[key] = (None, e)
    result, error = _runs[key]
    if error is not None:
        raise error
    return result
