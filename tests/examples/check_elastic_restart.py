"""Elastic restarts under torchrun's agent (docs/guide/launching.md, "Elastic restarts"), through
examples/01_ddp with ZeRO-1: two agents on this machine (`--nnodes 1:2 --max-restarts 3`, c10d
rendezvous on one endpoint), 2 workers each, training at world 4 and saving every 10 steps. Three
failures, each once the run has committed a checkpoint past the previous one:
  1. a worker of the second agent is SIGKILLed, its agent alive (a crashed process);
  2. a worker of the first agent likewise;
  3. the second agent and its workers are SIGKILLed (a node gone).
After 1 and 2 both agents restart their workers, which meet again in the agent's store (kept across
restart rounds: Note [Launch rounds], mesh/launch_round.h) and go on at world 4 from the latest
checkpoint; after 3 the first agent's workers go on alone at world 2 (the dead node is dropped after
keep_alive_interval x keep_alive_max_attempt = 2 s), resharded from DP 4 to DP 2. Checked:
- four attempts, at dp(4), dp(4), dp(4), dp(2), each resuming from the newest checkpoint its
  predecessor completed (a save cut short by a kill is never taken: the commit protocol);
- the losses of the dp(4) attempts equal, bit for bit, those of the uninterrupted 4-rank run (same
  world size, state restored exactly: nothing to differ);
- the dp(2) attempt's equal, bit for bit, a plain 2-rank run resumed from a copy of its checkpoint,
  and the uninterrupted 4-rank run's to rtol 1e-5 (fp32 sums in another order at DP 2, a few ulps a
  step that AdamW carries forward, as examples.01_ddp_same_losses_at_1_and_2_ranks).
The agent hosting the rendezvous (c10d: its TCPStore) and the workers' shared store must survive: the
node killed is the agent started second, whose workers hold group rank 1 (checked).
Usage: check_elastic_restart.py <ddp_example>."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from torchrun_losses import latest_step, read, run_losses

binary = sys.argv[1]
torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
STEPS, EVERY = 100, 10
# (what is killed, of which agent, once `latest` has reached this step)
FAILURES = [("worker", "second", 20), ("worker", "first", 40), ("node", "second", 60)]
TRAIN = ["--hidden", "16", "--layers", "2", "--global-batch", "8", "--distributed-optimizer", "--save-every", str(EVERY),
         "--timeout-s", "10", "--stuck-report-s", "0"]
RDZV = "join_timeout=60,last_call_timeout=5,close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2"


def fail(why, *logs):
    sys.exit("FAILED: " + why + "".join(f"\n--- {name}:\n{text}" for name, text in logs))


def start_agent(port, is_host, ckpt, log_base):
    cmd = [torchrun, "--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "3", "--monitor-interval", "0.2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-check",
           "--rdzv-conf", f"{RDZV},is_host={is_host}", "--no-python", binary, *TRAIN, "--steps", str(STEPS),
           "--save-dir", ckpt, "--resume"]
    # Its own session: the agent's process group is a node's to kill (its workers have their own).
    return subprocess.Popen(cmd, stdout=open(log_base + ".out", "w"), stderr=open(log_base + ".err", "w"),
                            start_new_session=True)


def workers_of(agent):
    try:
        return [int(p) for p in read(f"/proc/{agent.pid}/task/{agent.pid}/children").split()]
    except OSError:
        return []


def kill_node(agent, workers):
    """SIGKILL an agent's process group and each of its workers' (torchrun starts them in new sessions)."""
    for pgid in [agent.pid, *workers]:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def env_of(pid):
    return dict(e.split("=", 1) for e in read(f"/proc/{pid}/environ").split("\0") if "=" in e)


work = tempfile.mkdtemp(prefix="meshddp-elastic-")
agents = {}
try:
    ckpt = os.path.join(work, "ckpt")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logs = {name: os.path.join(work, name) for name in ("first", "second")}
    start = time.monotonic()
    agents["first"] = start_agent(port, 1, ckpt, logs["first"])
    time.sleep(0.3)  # the first agent hosts the rendezvous store and is rendezvous rank 0 (lower pid)
    agents["second"] = start_agent(port, 0, ckpt, logs["second"])
    all_logs = lambda: [(f"{n} agent's stderr", read(p + ".err")) for n, p in logs.items()]  # noqa: E731
    before = set()  # the workers of the attempt that the last failure ended
    for what, whose, at in FAILURES:
        # Wait for a checkpoint at or past `at` and for both agents' workers of a new attempt (none
        # that was running at the last failure) to be running.
        deadline = time.monotonic() + 90
        while True:
            workers = {n: workers_of(a) for n, a in agents.items()}
            if latest_step(ckpt) >= at and all(len(w) == 2 and not before & set(w) for w in workers.values()):
                break
            if time.monotonic() > deadline or any(a.poll() is not None for a in agents.values()):
                fail(f"no step-{at} committed and 2 + 2 workers of a new attempt running within 90 s (latest: step {latest_step(ckpt)}; "
                     f"agents exited: {[n for n, a in agents.items() if a.poll() is not None]})", *all_logs())
            time.sleep(0.02)
        victims = workers[whose]
        ranks = [env_of(p).get("GROUP_RANK") for p in victims]
        if ranks != [{"first": "0", "second": "1"}[whose]] * 2:
            fail(f"the {whose} agent runs workers of group rank {ranks} (pid order?); killing the agent of group rank "
                 "0 would take the rendezvous store with it")
        before = {p for w in workers.values() for p in w}
        if what == "worker":
            os.kill(victims[0], signal.SIGKILL)
        else:
            kill_node(agents[whose], victims)
        print(f"{time.monotonic() - start:5.1f} s: killed {'a worker of' if what == 'worker' else ''} the {whose} agent "
              f"at latest = step-{latest_step(ckpt)}")
    survivor = agents["first"]
    try:
        code = survivor.wait(timeout=90)
    except subprocess.TimeoutExpired:
        fail("the first agent did not finish within 90 s of the node loss", *all_logs())
    out, err = read(logs["first"] + ".out"), read(logs["first"] + ".err")
    print(f"the first agent exited {code}, {time.monotonic() - start:.1f} s after the start")
    if code != 0:
        fail(f"the first agent exited {code}", ("stdout", out), ("stderr", err))

    shapes = re.findall(r"^# meshddp example 01_ddp: (dp\(\d+\)) x tp\(1\)", err, re.M)
    resumed = [int(k) for _, k in re.findall(r"^# resumed from '(.*)' \(step (\d+)\)", err, re.M)]
    if shapes != ["dp(4)", "dp(4)", "dp(4)", "dp(2)"] or len(resumed) != 3:
        fail(f"expected attempts at dp(4), dp(4), dp(4), dp(2), the last three resuming; got {shapes}, resumed at "
             f"steps {resumed}", ("stderr", err))
    for (_, _, at), k in zip(FAILURES, resumed):
        if k < at:
            fail(f"an attempt resumed from step {k}, older than step-{at}, committed before the kill")
    peer_gone = re.findall(r"^ddp_example \(rank \d+\): meshddp: the collective .* failed or timed out: .*$", err, re.M)
    if not peer_gone:
        fail("the first agent's workers did not report the collective that lost its peer", ("stderr", err))
    print("a worker whose peer died failed with:", peer_gone[0])

    # Rank 0's printed steps, attempt after attempt. A killed attempt's last lines may be lost (its
    # stdout is a file, block-buffered, and the agent stops it), so the attempts are told apart by
    # where the dp(2) one starts: the last time step k3 (its resume step) is printed.
    steps = [(int(s), float(v)) for s, v in re.findall(r"^step (\d+) loss (\S+)$", out, re.M)]
    k = resumed[-1]
    start = max((i for i, (s, _) in enumerate(steps) if s == k), default=None)
    if start is None or [s for s, _ in steps[start:]] != list(range(k, STEPS)):
        fail(f"expected the dp(2) attempt to print steps {k}..{STEPS - 1}", ("stdout", out))
    if sorted({s for s, _ in steps[:start]} | set(range(k, STEPS))) != list(range(STEPS)):
        fail(f"the dp(4) attempts left steps unprinted below {k}", ("stdout", out))
    print(f"printed: {start} losses by the dp(4) attempts (steps 0..{steps[start - 1][0]}), then steps {k}.."
          f"{STEPS - 1} at dp(2)")

    uninterrupted = run_losses(binary, 4, STEPS, TRAIN)
    for s, v in steps[:start]:
        if v != uninterrupted[s]:
            fail(f"step {s}: loss {v!r} at dp(4) (first attempt or after a restart) vs {uninterrupted[s]!r} "
                 "uninterrupted (expected bit-identical)")
    print("the dp(4) attempts' losses equal the uninterrupted 4-rank run's, bit for bit")

    # The golden of the dp(2) attempt: a plain 2-rank run resumed from a copy of its checkpoint.
    with open(os.path.join(ckpt, f"step-{k}", "manifest.json")) as f:
        if json.load(f)["mesh"]["world_size"] != 4:
            fail(f"the dp(2) attempt resumed from step-{k}, which the dp(4) attempts did not write")
    golden_dir = os.path.join(work, "golden")
    shutil.copytree(os.path.join(ckpt, f"step-{k}"), os.path.join(golden_dir, f"step-{k}"))
    with open(os.path.join(golden_dir, "latest"), "w") as f:
        f.write(f"step-{k}\n")
    golden = run_losses(binary, 2, STEPS, [*TRAIN, "--save-dir", golden_dir, "--resume"], first=k)
    after = steps[start:]
    if [v for _, v in after] != golden:
        bad = next(i for i, (a, b) in enumerate(zip(after, golden)) if a[1] != b)
        fail(f"step {k + bad}: loss {after[bad][1]!r} after the node loss vs {golden[bad]!r} resumed by hand from "
             f"the same step-{k} at 2 ranks (expected bit-identical)")
    print(f"the dp(2) attempt's losses from step {k} equal a 2-rank run resumed from step-{k}, bit for bit")
    worst = max(abs(a - uninterrupted[s]) / abs(uninterrupted[s]) for s, a in after)
    if worst > 1e-5:
        fail(f"the dp(2) attempt's losses differ from the uninterrupted 4-rank run's by {worst:.1e} relative (rtol 1e-5)")
    print(f"and the uninterrupted 4-rank run's to rtol 1e-5 (largest relative difference {worst:.1e})")
finally:
    for agent in agents.values():
        if agent.poll() is None:
            kill_node(agent, workers_of(agent))
    shutil.rmtree(work, ignore_errors=True)
print("all passed")
