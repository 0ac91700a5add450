"""Ranks started with different flags: each example stops at start, on every rank, naming the first
flag that differs and each rank's value (before: it trained on silently and exited 0, or hung).
Two ranks launched by hand (torchrun gives every rank the same command line).
Usage: check_example_flag_agreement.py <ddp_example> <gpt_example> <train.py> <python package dir>."""
import os
import socket
import subprocess
import sys

ddp_binary, gpt_binary, train_py, package = sys.argv[1:5]
failures = []


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(commands, timeout=180):
    """Starts commands[r] as rank r of len(commands); returns [(exit code, stderr)] per rank."""
    port = str(free_port())
    procs = []
    for rank, cmd in enumerate(commands):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(len(commands)), LOCAL_WORLD_SIZE=str(len(commands)), PYTHONPATH=package)
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            err = f"(killed after {timeout} s: a hang)\n{err}"
        out.append((p.returncode, err))
    return out


def expect(name, results, *messages):
    ok = all(code != 0 and all(m in err for m in messages) for code, err in results)
    print(("ok   " if ok else "FAIL ") + name)
    if not ok:
        failures.append(name + "\n" + "\n".join(f"rank {r}: exit {c}\n{e}" for r, (c, e) in enumerate(results)))


common = ["--steps", "2"]
expect("gpt_example with --heads 4 / 2 stops naming --heads",
       run_ranks([[gpt_binary, "--dp", "2", "--tp", "1", *common, "--heads", heads] for heads in ("4", "2")]),
       "gpt_example: the command-line flags differ across the ranks of group 'meshddp/world/ranks=0,1'",
       "'--heads' is rank 0: 4, rank 1: 2")
expect("ddp_example with --lr on one rank only stops naming --lr",
       run_ranks([[ddp_binary, *common], [ddp_binary, *common, "--lr", "0.5"]]),
       "'--lr' is rank 0: (not given), rank 1: 0.5")
expect("train.py with --lr 0.01 / 0.02 stops naming --lr",
       run_ranks([[sys.executable, train_py, "--dp", "2", "--tp", "1", *common, "--lr", lr] for lr in ("0.01", "0.02")]),
       "the command-line flags differ across the ranks: '--lr' is rank 0: 0.01, rank 1: 0.02")

if failures:
    print("\n\n".join(failures))
    sys.exit(1)
