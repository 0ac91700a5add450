"""Elastic restarts of a pipeline under torchrun's agent: examples/02_dp_x_tp_gpt at pp 2 x dp 2 with
interleaved chunks (vpp 2) and ZeRO-1, one agent (`--standalone --nproc-per-node 4 --max-restarts 2`),
asynchronous saves every 3 steps. Two workers are SIGKILLed, each once the run has committed a
checkpoint past the previous kill: first a worker of the last stage (global rank 3), then one of
the first stage (global rank 0, which prints the losses). After each kill the agent stops the three
others and starts four new workers, which --resume from `latest`. Checked:
- three attempts, the last two resuming from a step at or past the one committed before the kill
  (a save cut short by the kill is never taken: Note [Async save protocol]), the agent exiting 0;
- every loss printed by any attempt equals, bit for bit, the uninterrupted run's at the same step
  (the same mesh and exact state: nothing to differ), and every step is printed.
Seen failing with the resume left out (the attempts restart from step 0: "resumed 0 times").
Usage: check_pipeline_elastic_restart.py <gpt_example>."""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from torchrun_losses import latest_step, read, run_losses

binary = sys.argv[1]
torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
STEPS, EVERY = 24, 3
KILLS = [(3, 6), (0, 15)]  # (global rank of the worker killed, once `latest` has reached this step)
TRAIN = ["--pp", "2", "--vpp", "2", "--dp", "2", "--tp", "1", "--layers", "4", "--micro-batches", "4",
         "--global-batch", "16", "--seed", "5", "--distributed-optimizer", "--timeout-s", "20", "--stuck-report-s", "0"]


def fail(why, *logs):
    sys.exit("FAILED: " + why + "".join(f"\n--- {name}:\n{text}" for name, text in logs))


def workers_by_rank(agent):
    """The agent's running workers, by their RANK (from /proc: no psutil)."""
    try:
        kids = [int(p) for p in read(f"/proc/{agent.pid}/task/{agent.pid}/children").split()]
    except OSError:
        return {}
    ranks = {}
    for kid in kids:
        try:
            env = dict(e.split("=", 1) for e in read(f"/proc/{kid}/environ").split("\0") if "=" in e)
        except OSError:
            continue
        if "RANK" in env:
            ranks[int(env["RANK"])] = kid
    return ranks


work = tempfile.mkdtemp(prefix="meshddp-pp-elastic-")
agent = None
try:
    ckpt = os.path.join(work, "ckpt")
    out_path, err_path = os.path.join(work, "agent.out"), os.path.join(work, "agent.err")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "4", "--max-restarts", "2", "--monitor-interval", "0.2",
           "--no-python", binary, *TRAIN, "--steps", str(STEPS), "--save-dir", ckpt, "--save-every", str(EVERY),
           "--async-save", "--resume"]
    start = time.monotonic()
    agent = subprocess.Popen(cmd, stdout=open(out_path, "w"), stderr=open(err_path, "w"), start_new_session=True)
    logs = lambda: [("the agent's stderr", read(err_path))]  # noqa: E731
    before = set()  # the workers of the attempt that the last kill ended
    committed = []  # `latest` at each kill
    for rank, at in KILLS:
        deadline = time.monotonic() + 120
        while True:
            workers = workers_by_rank(agent)
            if latest_step(ckpt) >= at and len(workers) == 4 and not before & set(workers.values()):
                break
            if time.monotonic() > deadline or agent.poll() is not None:
                fail(f"no step-{at} committed and 4 workers of a new attempt running within 120 s (latest: step "
                     f"{latest_step(ckpt)}; agent exit code {agent.poll()})", *logs())
            time.sleep(0.02)
        before = set(workers.values())
        committed.append(latest_step(ckpt))
        os.kill(workers[rank], signal.SIGKILL)
        print(f"{time.monotonic() - start:5.1f} s: killed rank {rank} at latest = step-{committed[-1]}")
    try:
        code = agent.wait(timeout=120)
    except subprocess.TimeoutExpired:
        fail("the agent did not finish within 120 s of the last kill", *logs())
    out, err = read(out_path), read(err_path)
    print(f"the agent exited {code}, {time.monotonic() - start:.1f} s after the start")
    if code != 0:
        fail(f"the agent exited {code}", ("stdout", out), ("stderr", err))

    attempts = [int(k) for _, k in re.findall(r"^# resumed from '(.*)' \(step (\d+)\)", err, re.M)]  # rank 0's
    if len(attempts) != len(KILLS):
        fail(f"expected {len(KILLS)} restarts, each resuming from a checkpoint; resumed {len(attempts)} times "
             f"(steps {attempts})", ("stderr", err))
    for c, k in zip(committed, attempts):
        if k < c:
            fail(f"an attempt resumed from step {k}, older than step-{c}, committed before its kill")
    print(f"the restarts resumed from steps {attempts} (committed before the kills: {committed})")

    printed = [(int(s), float(v)) for s, v in re.findall(r"^step (\d+) loss (\S+)$", out, re.M)]
    if sorted({s for s, _ in printed}) != list(range(STEPS)):
        fail(f"expected every step 0..{STEPS - 1} printed", ("stdout", out))
    uninterrupted = run_losses(binary, 4, STEPS, TRAIN)
    for s, v in printed:
        if v != uninterrupted[s]:
            fail(f"step {s}: loss {v!r} (first attempt or after a restart) vs {uninterrupted[s]!r} uninterrupted "
                 "(expected bit-identical)")
    print(f"{len(printed)} printed losses over 3 attempts equal the uninterrupted run's, bit for bit")
finally:
    if agent is not None and agent.poll() is None:
        os.killpg(agent.pid, signal.SIGKILL)
    shutil.rmtree(work, ignore_errors=True)
print("all passed")
