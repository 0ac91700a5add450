"""A node dies and the survivor goes on at the smaller world size, from the latest checkpoint, under
torchrun's elastic agent (docs/launching.md, "Elastic restarts"), through examples/01_ddp with ZeRO-1:
two agents on this machine (`--nnodes 1:2 --max-restarts 3`, c10d rendezvous on one endpoint), 2
workers each, train at world 4 saving every 10 steps; once `latest` names step-20, one agent and its
workers are SIGKILLed (a node gone). The other agent's workers fail at their next collective (Gloo:
connection closed; else --timeout-s 10), the agent restarts them, the rendezvous closes at world 2
(dead node dropped after keep_alive_interval x keep_alive_max_attempt = 2 s) and they --resume from
the latest complete checkpoint, resharded from DP 4 to DP 2, to the last step. Checked:
- the first attempt ran at dp(4), the restart at dp(2), resuming from the newest checkpoint the
  dp(4) attempt completed (a save cut short by the kill is never taken: the commit protocol);
- its losses from there equal, bit for bit, those of a plain 2-rank run resumed from a copy of that
  checkpoint (same checkpoint, same world size, same code: nothing to differ);
- and the uninterrupted 4-rank run's, to rtol 1e-5 (the fp32 sums are taken in another order at DP 2,
  a few ulps a step that AdamW carries forward, as examples.01_ddp_same_losses_at_1_and_2_ranks).
The agent hosting the rendezvous (c10d: its TCPStore) and rank 0's shared store must survive: the
one killed is the agent started second, whose workers hold group rank 1 (checked).
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

from torchrun_losses import run_losses

binary = sys.argv[1]
torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
STEPS, EVERY, KILL_AT = 120, 10, 20
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


def read(path):
    with open(path) as f:
        return f.read()


def latest(ckpt):
    try:
        return read(os.path.join(ckpt, "latest")).strip()
    except OSError:
        return ""


def workers_of(agent):
    return [int(p) for p in read(f"/proc/{agent.pid}/task/{agent.pid}/children").split()]


def kill_node(agent, workers):
    """SIGKILL an agent's process group and each of its workers' (torchrun starts them in new sessions)."""
    for pgid in [agent.pid, *workers]:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def group_rank(pid):
    env = dict(e.split("=", 1) for e in read(f"/proc/{pid}/environ").split("\0") if "=" in e)
    return env.get("GROUP_RANK")


work = tempfile.mkdtemp(prefix="meshddp-elastic-")
agents = []
try:
    ckpt = os.path.join(work, "ckpt")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logs = {name: os.path.join(work, name) for name in ("survivor", "killed")}
    start = time.monotonic()
    agents.append(start_agent(port, 1, ckpt, logs["survivor"]))
    time.sleep(0.3)  # the survivor hosts the rendezvous store and is rendezvous rank 0 (lower pid)
    agents.append(start_agent(port, 0, ckpt, logs["killed"]))
    survivor, victim = agents
    while latest(ckpt) != f"step-{KILL_AT}":
        if time.monotonic() - start > 90 or survivor.poll() is not None or victim.poll() is not None:
            fail(f"no step-{KILL_AT} committed within 90 s (latest: '{latest(ckpt)}')",
                 *((n, read(p + ".err")) for n, p in logs.items()))
        time.sleep(0.02)
    victims = workers_of(victim)
    ranks = [group_rank(p) for p in victims]
    if ranks != ["1", "1"]:
        fail(f"the agent started second runs workers of group rank {ranks}, expected 1 (pid order?); killing it "
             "would take the rendezvous store with it")
    kill_node(victim, victims)
    killed_at = time.monotonic()
    print(f"killed the second agent and its workers {killed_at - start:.1f} s in, latest = {latest(ckpt)}")
    try:
        code = survivor.wait(timeout=90)
    except subprocess.TimeoutExpired:
        fail("the surviving agent did not finish within 90 s of the kill", ("survivor stderr", read(logs["survivor"] + ".err")))
    out, err = read(logs["survivor"] + ".out"), read(logs["survivor"] + ".err")
    print(f"survivor exited {code} {time.monotonic() - killed_at:.1f} s after the kill")
    if code != 0:
        fail(f"the surviving agent exited {code}", ("stdout", out), ("stderr", err))
    # The newest checkpoint the 4-rank attempt completed (its manifest says world 4): read after the
    # fact, so a commit racing the kill cannot make the expectation wrong.
    saved_at_4 = []
    for name in os.listdir(ckpt):
        manifest = os.path.join(ckpt, name, "manifest.json")
        if name.startswith("step-") and os.path.exists(manifest):
            with open(manifest) as f:
                if json.load(f)["mesh"]["world_size"] == 4:
                    saved_at_4.append(int(name.split("-")[1]))
    if not saved_at_4 or max(saved_at_4) < KILL_AT:
        fail(f"the 4-rank attempt completed checkpoints at steps {sorted(saved_at_4)}, expected up to >= {KILL_AT}")
    resumed_from = f"step-{max(saved_at_4)}"
    shapes = re.findall(r"^# meshddp example 01_ddp: (dp\(\d+\)) x tp\(1\)", err, re.M)
    resumed = re.findall(r"^# resumed from '(.*)' \(step (\d+)\)", err, re.M)
    k = int(resumed_from.split("-")[1])
    if shapes != ["dp(4)", "dp(2)"] or resumed != [(os.path.join(ckpt, resumed_from), str(k))]:
        fail(f"expected a dp(4) attempt, then a dp(2) one resuming from '{resumed_from}'; got {shapes}, {resumed}",
             ("stderr", err))
    peer_gone = re.findall(r"^ddp_example \(rank \d+\): meshddp: the collective .* failed or timed out: .*$", err, re.M)
    if not peer_gone:
        fail("the survivor's workers did not report the collective that lost its peer", ("stderr", err))
    print("the survivor's workers failed with:", peer_gone[0])
    steps = [(int(s), float(v)) for s, v in re.findall(r"^step (\d+) loss (\S+)$", out, re.M)]
    # The first attempt printed 0..m (m >= k - 1; it may die before printing step k), the restart k..
    restart = max(i for i, (s, _) in enumerate(steps) if s == k)
    if [s for s, _ in steps[:restart]] != list(range(restart)) or restart < k:
        fail(f"the first attempt printed steps {[s for s, _ in steps[:restart]]}, expected 0..m with m >= {k - 1}",
             ("stdout", out))
    after = steps[restart:]
    if [s for s, _ in after] != list(range(k, STEPS)):
        fail(f"the restarted attempt printed steps {[s for s, _ in after]}, expected {k}..{STEPS - 1}", ("stdout", out))
    print(f"first attempt: steps 0..{steps[restart - 1][0]} at dp(4); restart: steps {k}..{STEPS - 1} at dp(2)")

    # The golden: a plain 2-rank run resumed from a copy of that checkpoint.
    golden_dir = os.path.join(work, "golden")
    shutil.copytree(os.path.join(ckpt, resumed_from), os.path.join(golden_dir, resumed_from))
    with open(os.path.join(golden_dir, "latest"), "w") as f:
        f.write(resumed_from + "\n")
    golden = run_losses(binary, 2, STEPS, [*TRAIN, "--save-dir", golden_dir, "--resume"], first=k)
    if [v for _, v in after] != golden:
        bad = next(i for i, (a, b) in enumerate(zip(after, golden)) if a[1] != b)
        fail(f"step {k + bad}: loss {after[bad][1]!r} after the elastic restart vs {golden[bad]!r} resumed by hand "
             f"from the same '{resumed_from}' at 2 ranks (expected bit-identical)")
    print(f"losses from step {k} equal a 2-rank run resumed from {resumed_from}, bit for bit")

    uninterrupted = run_losses(binary, 4, STEPS, TRAIN)
    for (s, a), b in zip(after, uninterrupted[k:]):
        if abs(a - b) > 1e-5 * abs(b):
            fail(f"step {s}: loss {a} after the elastic restart vs {b} uninterrupted at 4 ranks (rtol 1e-5)")
    worst = max(abs(a - b) / abs(b) for (_, a), b in zip(after, uninterrupted[k:]))
    print(f"and the uninterrupted 4-rank run's to rtol 1e-5 (largest relative difference {worst:.1e})")
finally:
    for agent in agents:
        if agent.poll() is None:
            kill_node(agent, workers_of(agent))
    shutil.rmtree(work, ignore_errors=True)
print("all passed")
