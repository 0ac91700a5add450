"""Checkpoints through examples/02_dp_x_tp_gpt: train 10 steps at 2x2 with --save-dir --save-every 5
(the reference curve; saves step-5 and step-10), then --resume from step-5 at 4x1 (and at 1x4 with
--distributed-optimizer, from the same plain-DDP checkpoint) up to step 10: the `step <n> loss`
lines continue at 5 and match the reference. Then meshddp-consolidate turns the 2x2 step-5 checkpoint into one
safetensors file, which a plain single-process PyTorch GPT (below, written from gpt.h) loads; its
loss on step 5's batch equals the example's step-5 loss.

Tolerances: the 2x2 prefix is the same computation (exact). Resumed at another mesh, steps 5..9 sum
in another fp32 order (the GoogleTest TrainingCheckpoint test measures < 2e-7 relative): rtol 1e-5.
The PyTorch model sums in yet another order (no TP): rtol 1e-5."""
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

from meshddp import consolidate  # noqa: E402  (the engine's checkpoint reader; needs only its _C)

binary = sys.argv[1]
SEED, BATCH = 1, 16
VOCAB, SEQ, DIM, HEADS, LAYERS = 64, 16, 32, 4, 2  # gpt::Config's defaults


def run(nproc, args, first, steps):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", f"--nproc-per-node={nproc}", "--no-python", binary, "--steps", str(steps),
           "--seed", str(SEED), "--global-batch", str(BATCH), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if out.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)} exited {out.returncode}\n{out.stdout}\n{out.stderr}")
    found = re.findall(r"^step (\d+) loss (\S+)$", out.stdout, re.M)
    if [int(s) for s, _ in found] != list(range(first, steps)):
        sys.exit(f"FAILED: expected 'step {first}..{steps - 1} loss X' from {' '.join(cmd)}, got:\n{out.stdout}\n{out.stderr}")
    return [float(v) for _, v in found], out.stderr


def close(a, b, rtol):
    return abs(a - b) <= rtol * abs(a)


def make_batch(step):
    """gpt::make_batch, with the same generator calls."""
    gen = torch.Generator().manual_seed(SEED * 7919 + step)
    start = torch.randint(VOCAB, (BATCH, 1), generator=gen)
    seq = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
    seq[:, 0] = start[:, 0]
    noise = torch.rand(BATCH, SEQ, generator=gen) < 0.1
    random = torch.randint(VOCAB, (BATCH, SEQ), generator=gen)
    for t in range(SEQ):
        seq[:, t + 1] = torch.where(noise[:, t], random[:, t], (seq[:, t] * 3 + 1) % VOCAB)
    return seq[:, :SEQ], seq[:, 1:]


def gpt_loss(p, ids, targets):
    """examples/02_dp_x_tp_gpt/gpt.h in plain PyTorch, on a state dict of full tensors."""
    def lin(x, name, bias=True):
        return F.linear(x, p[name + ".weight"], p[name + ".bias"] if bias else None)

    def ln(x, name):
        return F.layer_norm(x, (DIM,), p[name + ".weight"], p[name + ".bias"], 1e-5)

    h = p["wte.weight"][ids] + p["wpe.weight"][torch.arange(SEQ)].unsqueeze(0)
    hd = DIM // HEADS
    for layer in range(LAYERS):
        b = f"blocks.{layer}."
        x = ln(h, b + "ln1")
        split = lambda t: t.view(BATCH, SEQ, -1, hd).transpose(1, 2)  # noqa: E731
        q, k, v = split(lin(x, b + "attn.q")), split(lin(x, b + "attn.k", False)), split(lin(x, b + "attn.v"))
        scores = q @ k.transpose(-2, -1) / math.sqrt(hd)
        scores = scores.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))
        y = (torch.softmax(scores, -1) @ v).transpose(1, 2).contiguous().view(BATCH, SEQ, -1)
        h = h + lin(y, b + "attn.o")
        h = h + lin(F.gelu(lin(ln(h, b + "ln2"), b + "mlp.fc1")), b + "mlp.fc2")
    logits = F.linear(ln(h, "ln_f"), p["wte.weight"])
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)).item()


work = tempfile.mkdtemp(prefix="meshddp-ckpt-example-")
try:
    save_dir = os.path.join(work, "ckpt")
    # The uninterrupted run is also the save run: --save-every 5 saves step-5 and, at the end, step-10.
    reference, log = run(4, ["--dp", "2", "--tp", "2", "--save-dir", save_dir, "--save-every", "5"], 0, 10)
    print("2x2 uninterrupted:", reference)
    for name in ("step-5", "step-10"):
        if not os.path.exists(os.path.join(save_dir, name, "manifest.json")):
            sys.exit(f"FAILED: no complete {name} in {save_dir}: {os.listdir(save_dir)}\n{log}")
    # Consolidate step 5 before the resumed runs add step-10.
    out = os.path.join(work, "full.safetensors")
    subprocess.run([sys.executable, "-m", "meshddp.consolidate", save_dir, out, "--step", "5"], check=True)
    for dp, tp, extra in ((4, 1, ()), (1, 4, ("--distributed-optimizer",))):
        shutil.rmtree(os.path.join(save_dir, "step-10"), ignore_errors=True)
        with open(os.path.join(save_dir, "latest"), "w") as f:
            f.write("step-5\n")
        resumed, log = run(4, ["--dp", str(dp), "--tp", str(tp), "--save-dir", save_dir, "--resume", *extra], 5, 10)
        name = f"{dp}x{tp} {' '.join(extra)}".strip()
        print(f"resumed at {name}:", resumed)
        if "resumed from" not in log:
            sys.exit(f"FAILED: {name} did not say it resumed:\n{log}")
        for s, (a, b) in enumerate(zip(reference[5:], resumed)):
            if not close(a, b, 1e-5):
                sys.exit(f"FAILED: step {5 + s}: loss {a} uninterrupted vs {b} resumed at {name} (rtol 1e-5)")

    state = consolidate.load_safetensors(out)
    try:
        import safetensors.torch  # noqa: PLC0415  (optional: the reference reader agrees with ours)
        other = safetensors.torch.load_file(out)
        assert all(torch.equal(other[k], v) for k, v in state.items()) and other.keys() == state.keys()
        print("the safetensors package reads the same tensors")
    except ImportError:
        pass
    ids, targets = make_batch(5)
    loss = gpt_loss(state, ids, targets)
    print(f"consolidated step-5 model in plain PyTorch: loss {loss:.10g} (example at step 5: {reference[5]:.10g})")
    if not close(reference[5], loss, 1e-5):
        sys.exit(f"FAILED: the consolidated model's loss {loss} differs from the example's {reference[5]} (rtol 1e-5)")
finally:
    shutil.rmtree(work, ignore_errors=True)
print("1 passed, 0 failed")
