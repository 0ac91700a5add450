"""Resuming means resuming, and ranks that diverge fail in seconds, through examples/01_ddp:
1. --resume beside a damaged `latest` stops (exit 1) naming the file and --resume-step, instead of
   training from step 0; --resume into an empty directory says it starts at step 0.
2. A rollback: saves at 2, 4, 6, 8; --resume-step 4 --save-every 5 --keep-last 3 saves 5 and 8
   (the last step): the live run keeps step-4, step-5 and a new step-8 (parent step-5), deletes the
   abandoned step-6 and step-2; --resume then continues from the new step-8.
3. Ranks launched with different --save-every (rank 0 saves every step, rank 1 every 2 steps) would be
   in different collectives after step 1 (before, they waited for --timeout-s 120): the examples'
   flag agreement now stops both at start, exit 1 within seconds, naming '--save-every'. Ranks that
   reach different collectives anyway fail within seconds naming both (Note [Divergent
   collectives]): tests/mesh/collective_divergence_test.cpp, on real Gloo groups.
Usage: check_resume_and_divergence.py <ddp_example>."""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

binary = sys.argv[1]
torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
SMALL = ["--hidden", "32", "--layers", "2", "--global-batch", "8"]
failures = []


def run(args, nproc=2, timeout=120):
    cmd = [torchrun, "--standalone", f"--nproc-per-node={nproc}", "--no-python", binary, *SMALL, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return out.returncode, out.stdout, out.stderr


def expect(name, ok, detail):
    print(("ok   " if ok else "FAIL ") + name)
    if not ok:
        failures.append(f"{name}\n{detail}")


def steps_printed(stdout):
    return [int(s) for s in re.findall(r"^step (\d+) loss \S+$", stdout, re.M)]


work = tempfile.mkdtemp(prefix="meshddp-resume-example-")
try:
    # 1. A damaged `latest` is an error, never a fresh start; an empty directory is, and says so.
    ckpt = os.path.join(work, "damaged")
    code, out, err = run(["--steps", "4", "--save-dir", ckpt, "--save-every", "2"])
    expect("saves step-2 and step-4", code == 0 and os.path.exists(os.path.join(ckpt, "step-4", "manifest.json")), err)
    with open(os.path.join(ckpt, "latest"), "w") as f:
        f.write("stdp-4\n")  # a flipped byte
    code, out, err = run(["--steps", "6", "--save-dir", ckpt, "--resume"])
    expect("--resume beside a damaged latest exits 1 naming it and --resume-step",
           code == 1 and steps_printed(out) == [] and "latest' holds 'stdp-4', which is not a step directory name" in err
           and "(complete: step-2 step-4; incomplete: none)" in err and "--resume-step N" in err,
           f"exit {code}\nstdout:\n{out}\nstderr:\n{err}")
    code, out, err = run(["--steps", "6", "--save-dir", ckpt, "--resume-step", "2"])
    expect("--resume-step 2 continues at step 2", code == 0 and steps_printed(out) == [2, 3, 4, 5], err)
    code, out, err = run(["--steps", "2", "--save-dir", os.path.join(work, "empty"), "--resume"])
    expect("--resume into an empty directory says it starts at step 0",
           code == 0 and steps_printed(out) == [0, 1] and "# --resume: no checkpoint in" in err, err)

    # 2. A rollback with --keep-last counts the live run.
    ckpt = os.path.join(work, "rollback")
    code, out, err = run(["--steps", "8", "--save-dir", ckpt, "--save-every", "2"])
    expect("saves 2, 4, 6, 8", code == 0, err)
    code, out, err = run(["--steps", "8", "--save-dir", ckpt, "--save-every", "5", "--keep-last", "3", "--resume-step", "4"])
    left = sorted(n for n in os.listdir(ckpt) if n.startswith("step-"))
    with open(os.path.join(ckpt, "step-8", "manifest.json")) as f:
        parent = json.load(f).get("parent")
    expect("--resume-step 4 --save-every 5 --keep-last 3 keeps step-4, step-5 and the new step-8",
           code == 0 and steps_printed(out) == [4, 5, 6, 7] and left == ["step-4", "step-5", "step-8"]
           and parent == "step-5",
           f"exit {code}, left {left}, step-8's parent {parent}\n{err}")
    code, out, err = run(["--steps", "10", "--save-dir", ckpt, "--resume"])
    expect("--resume continues the new timeline from step 8", code == 0 and steps_printed(out) == [8, 9], err)

    # 3. Rank 0 saves every step, rank 1 every 2: launched by hand (torchrun gives every rank the
    #    same flags), with a 2 s report threshold and a 120 s timeout.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ckpt = os.path.join(work, "diverge")
    procs = []
    start = time.monotonic()
    for rank, every in ((0, "1"), (1, "2")):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen([binary, *SMALL, "--steps", "6", "--save-dir", ckpt, "--save-every", every,
                                       "--stuck-report-s", "2", "--timeout-s", "120"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = [p.communicate(timeout=150) for p in procs]
    seconds = time.monotonic() - start
    errs = "\n".join(e for _, e in results)
    print(f"diverged ranks exited {[p.returncode for p in procs]} after {seconds:.1f} s")
    expect("ranks saving at different intervals stop at start within seconds naming --save-every",
           all(p.returncode == 1 for p in procs) and seconds < 60
           and all("the command-line flags differ across the ranks" in e and "'--save-every' is rank 0: 1, rank 1: 2" in e
                   for _, e in results),
           f"exits {[p.returncode for p in procs]} after {seconds:.1f} s\n{errs}")
finally:
    shutil.rmtree(work, ignore_errors=True)

if failures:
    sys.exit("FAILED:\n" + "\n\n".join(failures))
print("all passed")
