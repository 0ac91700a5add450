"""Kills at random points of asynchronous saves, through examples/02_dp_x_tp_gpt at dp 2 with
--async-save --save-every 1 (a save after every step: the background write of step n's checkpoint
overlaps step n+1, and its commit comes at a later step boundary):

1. The reference: the uninterrupted run without saves.
2. Runs that --resume from the same directory, each SIGKILLed at a random moment (a random step's
   `step <n> loss` line plus a random 0-25 ms): alternately one worker (torchrun stops the other) and
   the whole group. Each resumed run must start at the step `latest` named when it was launched (a
   save cut short is never taken: Note [Async save protocol]) and print exactly the reference's
   losses (the same mesh: bit for bit, compared as printed, 10 significant digits), until a last run
   reaches the end and commits the last step.
Reports how many kills landed inside a save (a step directory without manifest, or a manifest that
`latest` does not name yet) and how many saves were started. Usage: check_async_save_kills.py
<gpt_example> [kills]. The random seed is printed; MESHDDP_KILL_SEED=<n> repeats a run."""
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
KILLS = int(sys.argv[2]) if len(sys.argv) > 2 else 12
STEPS = 30
torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
BASE = [torchrun, "--standalone", "--nproc-per-node=2", "--no-python", binary, "--dp", "2", "--tp", "1",
        "--steps", str(STEPS), "--seed", "3", "--global-batch", "8", "--distributed-optimizer"]
STEP_LINE = re.compile(r"^step (\d+) loss (\S+)$")


def fail(msg):
    sys.exit(f"FAILED: {msg}")


def children(pid):
    """Direct children of `pid` (from /proc: no psutil)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    out.append(int(entry))
            except OSError:
                pass
    return out


def latest_step(ckpt):
    try:
        with open(os.path.join(ckpt, "latest")) as f:
            return int(f.read().strip()[len("step-"):])
    except FileNotFoundError:
        return 0


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
        first = latest_step(ckpt)
        if first == STEPS:  # a kill raced the end of a run that had committed its last step
            break
        kill = kills < KILLS and first < STEPS - 1
        target = rng.randrange(first, STEPS - 1) if kill else None
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
                fail(f"a run launched with `latest` at step {first} resumed at step {step}")
            seen.append(step)
            if loss != reference[step]:
                fail(f"step {step}: loss {loss} after resuming at {first}, the uninterrupted run's is {reference[step]}")
            if kill and step == target and not killed:
                time.sleep(delay)
                try:
                    if whole_group:
                        os.killpg(proc.pid, signal.SIGKILL)
                    else:
                        workers = children(proc.pid)
                        if workers:
                            os.kill(rng.choice(workers), signal.SIGKILL)
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
