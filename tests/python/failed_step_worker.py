"""Rank script for test_failed_step.py, run under torchrun on 2 ranks (Gloo, CPU): the ranks disagree
in the middle of training, every rank catches the error, prints it with the time (and writes both to
DIRECTORY.rankN.failure: the ranks' lines on the shared stdout can interleave), and returns, so that
the time from the failure to the process's exit (the engine's destructors included) can be measured
by the launcher.

  skipped_save    rank 0 saves a checkpoint that rank 1 skips: rank 0 waits in the save's agreement,
                  rank 1 in the next step's gradient reduction, with more buckets in flight
  async_mismatch  the ranks pass different async_save to save_checkpoint()

Usage: failed_step_worker.py SCENARIO DIRECTORY TIMEOUT_S"""

import datetime
import os
import sys
import time

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dcp_workers  # noqa: E402  (the ZeRO-1 model and training loop of the checkpoint tests)


def run(scenario, directory):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ddp, opt = dcp_workers.build(world_size, 0, "adamw_fp32")
    dcp_workers.train(ddp, opt, rank, world_size, range(2))
    try:
        if scenario == "skipped_save":
            if rank == 0:
                opt.save_checkpoint(directory)
            dcp_workers.train(ddp, opt, rank, world_size, range(2, 4))
        else:
            opt.save_checkpoint(directory, async_save=rank == 0)
            opt.wait_checkpoint()
        print(f"rank {rank}: no error", flush=True)
    except RuntimeError as e:
        failed_at = time.time()
        print(f"rank {rank} failed at {failed_at:.3f}: {e}", flush=True)
        # Also to a file of its own: the two ranks' lines on the shared stdout can interleave.
        with open(f"{directory}.rank{rank}.failure", "w") as f:
            f.write(f"{failed_at:.3f}\n{e}")
    # ddp and opt (their flat buffers and in-flight collectives) are destroyed on return.


if __name__ == "__main__":
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(sys.argv[3])))
    run(sys.argv[1], sys.argv[2])
    print(f"rank {dist.get_rank()} returned at {time.time():.3f}", flush=True)
    # What is measured ends here (the engine's destructors ran as run() returned). Skip the interpreter's
    # finalization: the process group is left alive after the failed collectives, and a Gloo worker thread
    # dropping a tensor's last Python reference while Python finalizes ends in std::terminate (seen once in a
    # loaded run: pthread_exit from PyEval_AcquireThread), which has nothing to do with the failed step.
    os._exit(0)
