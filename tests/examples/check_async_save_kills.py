"""Kills at random points of asynchronous saves, through examples/02_dp_x_tp_gpt at dp 2 with
--async-save --save-every 1 (a save after every step: the background write of step n's checkpoint
overlaps step n+1, and its commit comes at a later step boundary):

1. The reference: the uninterrupted run without saves.
2. Runs that --resume from the same directory, each SIGKILLed at a random moment (the `step <n> loss`
   line of a random step 0-4 steps after its resume point, plus a random 0-25 ms: a step takes ~15 ms
   and each save's background write ~10 ms, so most kills land inside a save): alternately one worker (torchrun stops the other) and
   the whole group. Each resumed run must start at the step `latest` named when it was launched (a
   save cut short is never taken: Note [Async save protocol]) and print exactly the reference's
   losses (the same mesh: bit for bit, compared as printed, 10 significant digits), until a last run
   reaches the end and commits the last step.
Reports how many kills landed inside a save (a step directory without manifest, or a manifest that
`latest` does not name yet) and how many saves were started. Usage: check_async_save_kills.py
<gpt_example> [kills] [pp]; with `pp` the same on a 2-stage pipeline (--pp 2, dp 1: each rank saves its
stage's chunk). The random seed is printed; MESHDDP_KILL_SEED=<n> repeats a run."""
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

binary = sys.argv[1]
KILLS = int(sys.argv[2]) if len(sys.argv) > 2 else 6
MESH = ["--pp", "2"] if sys.argv[3:] == ["pp"] else ["--dp", "2"]
STEPS = 30
torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
BASE = [torchrun, "--standalone", "--nproc-per-node=2", "--no-python", binary, *MESH, "--tp", "1",
        "--steps", str(STEPS), "--seed", "3", "--global-batch", "8", "--distributed-optimizer"]
STEP_LINE = re.compile(r"^step (\d+) loss (\S+)$")


def fail(msg):
    sys.exit(f"FAILED: {msg}")


def workers_of(pid):
    """torchrun `pid`'s workers: its children running the example (from /proc: no psutil)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(p) for p in f.read().split()]
    except OSError:
        return []
    out = []
    for kid in kids:
        try:
            with open(f"/proc/{kid}/cmdline", "rb") as f:
                if os.path.basename(binary).encode() in f.read():
                    out.append(kid)
        except OSError:
            pass
    return out


def latest_step(ckpt):
    """The step `latest` names; 0 without a `latest` file."""
    try:
        with open(os.path.join(ckpt, "latest")) as f:
            return int(f.read().strip()[len("step-"):])
    except FileNotFoundError:
        return 0


def resume_step(ckpt):
    """Where --resume must start: `latest`'s step; without `latest` (a kill between the first save's
    manifest and its pointer) the newest complete step (every save here continues the one before, so
    it is the live run's head: docs/reference/checkpoints.md, "The live run"); 0 without either."""
    if os.path.exists(os.path.join(ckpt, "latest")):
        return latest_step(ckpt)
    complete = [int(n[len("step-"):]) for n in (os.listdir(ckpt) if os.path.isdir(ckpt) else [])
                if n.startswith("step-") and os.path.exists(os.path.join(ckpt, n, "manifest.json"))]
    return max(complete, default=0)


def mid_save(ckpt, latest):
    """Whether the directory shows a save cut short: a step without manifest, or one newer than `latest`."""
    for name in os.listdir(ckpt) if os.path.isdir(ckpt) else []:
        if name.startswith("step-"):
            complete = os.path.exists(os.path.join(ckpt, name, "manifest.json"))
            if not complete or int(name[len("step-"):]) > latest:
                return True
    return False


def launch(args):
    return subprocess.Popen(BASE + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def main():
    seed = int(os.environ.get("MESHDDP_KILL_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    print(f"seed {seed} (MESHDDP_KILL_SEED={seed} repeats this run)")
    work = tempfile.mkdtemp(prefix="meshddp-async-kills-")
    ckpt = os.path.join(work, "ckpt")
    start = time.monotonic()
    ref = subprocess.run(BASE, capture_output=True, text=True, timeout=120)
    if ref.returncode != 0:
        fail(f"the reference run exited {ref.returncode}\n{ref.stderr}")
    reference = {int(s): v for s, v in re.findall(r"^step (\d+) loss (\S+)$", ref.stdout, re.M)}
    if sorted(reference) != list(range(STEPS)):
        fail(f"the reference printed steps {sorted(reference)}")
    args = ["--save-dir", ckpt, "--save-every", "1", "--keep-last", "3", "--async-save", "--resume"]
    kills = mid = started_saves = 0
    while True:
        first = resume_step(ckpt)
        if first == STEPS:  # a kill raced the end of a run that had committed its last step
            break
        kill = kills < KILLS and first < STEPS - 1
        target = min(first + rng.randrange(0, 5), STEPS - 2) if kill else None  # 0-4 steps in: a few saves per run
        delay = rng.uniform(0, 0.025)
        whole_group = kills % 2 == 1
        proc = launch(args)
        err_chunks = []
        reader = threading.Thread(target=lambda: err_chunks.append(proc.stderr.read()), daemon=True)
        reader.start()
        seen = []
        killed = False
        for line in proc.stdout:
            m = STEP_LINE.match(line.strip())
            if not m:
                continue
            step, loss = int(m.group(1)), m.group(2)
            if not seen and step != first:
                fail(f"a run launched when `latest` (or the newest complete step) was step {first} resumed at step {step}")
            seen.append(step)
            if loss != reference[step]:
                fail(f"step {step}: loss {loss} after resuming at {first}, the uninterrupted run's is {reference[step]}")
            if kill and step == target and not killed:
                time.sleep(delay)
                # torchrun starts its workers in sessions of their own: the whole group is torchrun's
                # process group and every worker.
                workers = workers_of(proc.pid)
                for pid in (workers if whole_group else [rng.choice(workers)] if workers else []):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                if whole_group:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                killed = True
        proc.wait(timeout=120)
        reader.join(timeout=10)
        stderr = "".join(err_chunks)
        started_saves += stderr.count("started after step")
        if killed:
            kills += 1
            now = latest_step(ckpt)
            cut = mid_save(ckpt, now)
            mid += cut
            print(f"kill {kills} ({'the whole group' if whole_group else 'one worker'}) after step {target} + "
                  f"{delay * 1000:.0f} ms: resumed at {first}, ran to {seen[-1] if seen else '-'}, `latest` now step "
                  f"{now}{', a save cut short on disk' if cut else ''}")
            continue
        if proc.returncode != 0:
            fail(f"the run resumed at {first} exited {proc.returncode}\n{stderr[-3000:]}")
        if not seen or seen[-1] != STEPS - 1 or latest_step(ckpt) != STEPS:
            fail(f"the last run (resumed at {first}) printed {seen} and left `latest` at {latest_step(ckpt)}\n"
                 f"{stderr[-3000:]}")
        if "committed at the boundary" not in stderr:
            fail(f"the last run's step log names no commit:\n{stderr[-3000:]}")
        break
    print(f"OK: {kills} kills, {mid} of them inside a save; {started_saves} async saves started; every resume "
          f"started at `latest` and matched the uninterrupted losses bit for bit ({time.monotonic() - start:.0f} s)")
    shutil.rmtree(work, ignore_errors=True)


main()
