"""How the examples fail: bad flags exit 2 with a message naming the flag (before any rank starts);
an injected NaN gradient stops a plain-DDP run on its step with the library's report (param, rank,
step); with ZeRO-1 a skipped step is reported and the run stops after --max-skipped-steps in a row.
Usage: check_example_failures.py <ddp_example> <gpt_example>."""
import os
import re
import subprocess
import sys

ddp_binary, gpt_binary = sys.argv[1], sys.argv[2]
torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
failures = []


def run(cmd, timeout=240):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return out.returncode, out.stdout, out.stderr


def expect(name, ok, detail):
    print(("ok   " if ok else "FAIL ") + name)
    if not ok:
        failures.append(f"{name}\n{detail}")


# 1. Bad flags: exit 2, the flag named, nothing launched (no torchrun needed: parsing comes first).
for binary, args, message in (
    (gpt_binary, ["--steps", "1e3"], "--steps: '1e3' is not an integer"),
    (gpt_binary, ["--steps", "0"], "--steps must be in [1, ...], got 0"),
    (gpt_binary, ["--heads", "0"], "--heads must be in [1, ...], got 0"),
    (gpt_binary, ["--dim", "30", "--heads", "4"], "--dim 30 must divide by --heads 4"),
    (gpt_binary, ["--tp", "3"], "--heads 4 must divide by --tp 3"),
    (gpt_binary, ["--lr", "1e-2x"], "--lr: '1e-2x' is not a number"),
    (gpt_binary, ["--lr", "nan"], "--lr: 'nan' is out of range"),
    (gpt_binary, ["--inject-nan", "3"], "--inject-nan: '3' is not STEP:RANK"),
    (gpt_binary, ["--lr-decay-style", "cosin"], "--lr-decay-style: 'cosin' is not one of constant, linear, cosine"),
    (gpt_binary, ["--ep", "2"], "--ep 2 needs --experts"),
    (gpt_binary, ["--experts", "2", "--top-k", "3"], "--top-k 3 must be at most --experts 2"),
    (gpt_binary, ["--experts", "4", "--dp", "3", "--global-batch", "12", "--ep", "3"], "--experts 4 must divide by --ep 3"),
    (gpt_binary, ["--experts", "4", "--dp", "1", "--ep", "2"], "--ep 2 must divide --dp 1 (expert-parallel groups"),
    (gpt_binary, ["--experts", "4", "--tp", "2", "--sequence-parallel"],
     "--sequence-parallel with --experts is not supported"),
    (gpt_binary, ["--dtype", "fp16"], "--dtype: 'fp16' is not one of fp32, bf16"),
    (gpt_binary, ["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 needs --dtype bf16"),
    (gpt_binary, ["--dtype", "bf16", "--save-dir", "ckpt"], "--dtype bf16 with --save-dir needs --distributed-optimizer"),
    (gpt_binary, ["--micro-batches", "3"], "--global-batch 16 must divide by --dp 1 x --micro-batches 3"),
    # Pipeline flags (--pp, --vpp, --grad-sync): refused before any rank starts, expected vs given.
    (gpt_binary, ["--pp", "3"], "--layers 2 must divide by --pp 3 x --vpp 1 (each model chunk holds"),
    (gpt_binary, ["--vpp", "2"], "--vpp 2 needs --pp > 1"),
    (gpt_binary, ["--pp", "2", "--vpp", "2", "--layers", "4", "--micro-batches", "3", "--global-batch", "12"],
     "--micro-batches 3 must divide by --pp 2 with --vpp > 1"),
    (gpt_binary, ["--grad-sync", "end"], "--grad-sync end needs a pipeline (--pp)"),
    (gpt_binary, ["--pp", "2", "--grad-sync", "later"], "--grad-sync: 'later' is not one of bubble, end"),
    (ddp_binary, ["--dtype", "bf16", "--save-dir", "ckpt"], "--dtype bf16 with --save-dir needs --distributed-optimizer"),
    (ddp_binary, ["--global-batch", "-4"], "--global-batch must be in [1, ...], got -4"),
    (ddp_binary, ["--log-interval", "2.5"], "--log-interval: '2.5' is not an integer"),
):
    code, out, err = run([binary, *args], timeout=60)
    expect(f"{os.path.basename(binary)} {' '.join(args)}: exit 2 naming the flag",
           code == 2 and message in err and "usage:" in err, f"exit {code}\nstderr:\n{err}")


# --help: the usage on stdout, exit 0 (was "flag --help needs a value", exit 2).
for binary in (gpt_binary, ddp_binary):
    for flag in ("--help", "-h"):
        code, out, err = run([binary, flag], timeout=60)
        expect(f"{os.path.basename(binary)} {flag}: the usage, exit 0",
               code == 0 and out.startswith("usage: ") and "--steps N" in out and not err,
               f"exit {code}\nstdout:\n{out}\nstderr:\n{err}")


def torchrun_cmd(binary, nproc, *args):
    return [torchrun, "--standalone", f"--nproc-per-node={nproc}", "--no-python", binary, *args]


def steps_printed(stdout):
    return [int(s) for s in re.findall(r"^step (\d+) loss \S+$", stdout, re.M)]


# 2. Plain DDP (check_for_nan_in_grad): a NaN on rank 1 at step 2 stops the run at step 2 with the
#    library's report naming the param, rank 1 and step 2, on every rank.
code, out, err = run(torchrun_cmd(gpt_binary, 2, "--dp", "2", "--tp", "1", "--steps", "6", "--inject-nan", "2:1"))
expect("gpt_example plain DDP --inject-nan 2:1 stops at step 2 with the report",
       code != 0 and steps_printed(out) == [0, 1]
       and "GradBuffer: non-finite gradients at step 2" in err
       and "rank 1 (DP rank 1): parameter 'wte.weight' has 1 NaN/Inf gradient value(s)" in err
       and "gpt_example (rank 0)" in err,
       f"exit {code}\nstdout:\n{out}\nstderr:\n{err}")
code, out, err = run(torchrun_cmd(ddp_binary, 2, "--steps", "4", "--hidden", "32", "--inject-nan", "1:0"))
expect("ddp_example --inject-nan 1:0 stops at step 1 naming rank 0",
       code != 0 and steps_printed(out) == [0]
       and "rank 0 (DP rank 0): parameter 'blocks.0.weight' has 1 NaN/Inf gradient value(s)" in err,
       f"exit {code}\nstdout:\n{out}\nstderr:\n{err}")

# On a pipeline the stop is agreed over every stage: a NaN on the last stage (rank 1 of --pp 2) stops both
# ranks at step 2, each naming the param, its stage and rank (the first stage did not see it).
code, out, err = run(torchrun_cmd(gpt_binary, 2, "--pp", "2", "--micro-batches", "2", "--steps", "5",
                                  "--inject-nan", "2:1"))
expect("gpt_example plain DDP --pp 2 --inject-nan 2:1 stops every stage at step 2 naming the stage",
       code != 0 and steps_printed(out) == [0, 1]
       and "GradBuffer: non-finite gradients at step 2" in err
       and "pipeline stage 1 of 2, rank 0 of the stage (DP rank 0): parameter '" in err
       and "gpt_example (rank 0)" in err and "gpt_example (rank 1)" in err,
       f"exit {code}\nstdout:\n{out}\nstderr:\n{err}")

# An injection that would never fire (a rank or step the run does not have) is refused, naming the flag:
# a NaN test that passes without its NaN tests nothing.
for spec, message in (("2:5", "--inject-nan 2:5: rank 5 is not a rank of this run (world size 2)"),
                      ("9:1", "--inject-nan 9:1: step 9 is not one this run takes (steps 0 to 3)")):
    code, out, err = run(torchrun_cmd(gpt_binary, 2, "--dp", "2", "--tp", "1", "--steps", "4", "--inject-nan", spec))
    expect(f"gpt_example --inject-nan {spec} is refused before training", code != 0 and steps_printed(out) == []
           and message in err, f"exit {code}\nstdout:\n{out}\nstderr:\n{err}")

# 3. ZeRO-1: one NaN step is skipped and reported; the run goes on (exit 0, 1 skipped in the summary).
#    With --max-skipped-steps 1 the same run stops there.
zero = ["--dp", "2", "--tp", "1", "--steps", "5", "--distributed-optimizer", "--inject-nan", "2:1"]
code, out, err = run(torchrun_cmd(gpt_binary, 2, *zero))
expect("gpt_example ZeRO-1 skips the NaN step, reports it, and finishes",
       code == 0 and steps_printed(out) == [0, 1, 2, 3, 4]
       and "step 2 skipped (1 in a row, --max-skipped-steps 3): DistributedOptimizer: step skipped" in err
       and "DP rank 1 produced 1 non-finite value(s) in its local gradient of parameter" in err
       and re.search(r"# summary: 5 steps, .* 1 skipped step\(s\)", err) is not None,
       f"exit {code}\nstdout:\n{out}\nstderr:\n{err}")
code, out, err = run(torchrun_cmd(gpt_binary, 2, *zero, "--max-skipped-steps", "1"))
expect("gpt_example ZeRO-1 --max-skipped-steps 1 stops at the skipped step",
       code != 0 and steps_printed(out) == [0, 1]
       and "stopping: 1 consecutive steps skipped for non-finite gradients (--max-skipped-steps 1)" in err,
       f"exit {code}\nstdout:\n{out}\nstderr:\n{err}")

# 4. The step log: rank 0, every --log-interval steps, and the summary.
code, out, err = run(torchrun_cmd(gpt_binary, 2, "--dp", "2", "--tp", "1", "--steps", "6", "--log-interval", "3",
                                  "--warmup-steps", "2", "--lr-decay-style", "cosine"))
lines = [l for l in err.splitlines() if l.startswith(" step ")]
expect("gpt_example logs every 3 steps with lr, grad norm, tokens/s, memory, and a summary",
       code == 0 and len(lines) == 2 and lines[0].startswith(" step 3/6 | loss ")
       and all(k in lines[0] for k in ("| lr ", "| grad norm ", "ms/step", "tokens/s", "samples/s", "| skipped 0",
                                       "| peak mem ", "MiB RSS"))
       and "# summary: 6 steps, mean step time" in err and steps_printed(out) == list(range(6)),
       f"exit {code}\nstderr:\n{err}")

if failures:
    sys.exit("FAILED:\n" + "\n\n".join(failures))
print(f"all passed")
