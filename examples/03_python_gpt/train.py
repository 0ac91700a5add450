"""Example 03: a tiny GPT written in plain PyTorch, tensor-parallel with torch's own TP
(parallelize_module over the "tp" dim of a 2-D DeviceMesh) and data-parallel with meshddp, with
torch's AdamW or meshddp's ZeRO-1 DistributedOptimizer. Launch with torchrun:

    torchrun --standalone --nproc-per-node 4 examples/03_python_gpt/train.py --dp 2 --tp 2 --steps 30
             [--distributed-optimizer] [--global-batch 16] [--seed 1] [--lr 3e-3] [--log-file PATH]
             [--dtype fp32|bf16 [--grad-reduce-in-bf16]]

stdout (or --log-file, rank 0): `step <n> loss <loss>` per step, the mean loss over the whole global
batch with 10 significant digits, like the C++ examples; stderr: a status line per step. The same
--seed and --global-batch give the same loss curve at any DP x TP (to fp32 tolerance).

--dtype bf16: bf16 params and activations, fp32 main grads (grad_reduce_in_fp32) and fp32 master
weights: ZeRO-1's own, or with torch's AdamW a whole fp32 copy it steps (Megatron's
Float16OptimizerWithFloat16Params). --grad-reduce-in-bf16: main grads accumulated and reduced in bf16;
needed at --tp > 1, where torch's TP makes the params DTensors, whose .grad is a view of meshddp's
buffer in the param's own dtype (docs/reference/python_api.md "Limits")."""

import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import meshddp


class Attention(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.head_dim = dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.k = torch.nn.Linear(dim, dim, bias=False)  # softmax is invariant to a key bias
        self.v = torch.nn.Linear(dim, dim)
        self.o = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, t, _ = x.shape
        # -1 heads: under TP, q/k/v hold this rank's heads only.
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        y = torch.softmax(scores.masked_fill(causal, float("-inf")), -1) @ v
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, 4 * dim)
        self.fc2 = torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Gpt(torch.nn.Module):
    """No parallelism in here: tp_plan() below is applied to it from outside."""

    def __init__(self, vocab=64, seq_len=16, dim=32, heads=4, layers=2):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)
        self.wpe = torch.nn.Embedding(seq_len, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied: one param, deduplicated by meshddp
        torch.nn.init.normal_(self.wte.weight, std=0.02)  # GPT-2's init; N(0, 1) would make the tied logits huge

    def forward(self, ids):
        h = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


def tp_plan(layers):
    """Megatron-style: q/k/v and fc1 column-parallel, o and fc2 row-parallel; the rest replicated."""
    plan = {}
    for i in range(layers):
        for name in ("attn.q", "attn.k", "attn.v", "fc1"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.o", "fc2"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return plan


def make_batch(vocab, seq_len, seed, step, batch):
    """Synthetic data from (seed, step): noisy "next token = (token * 3 + 1) mod vocab"."""
    g = torch.Generator().manual_seed(seed * 7919 + step)
    seq = torch.empty(batch, seq_len + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(vocab, (batch,), generator=g)
    noise = torch.rand(batch, seq_len, generator=g) < 0.1
    random = torch.randint(vocab, (batch, seq_len), generator=g)
    for t in range(seq_len):
        seq[:, t + 1] = torch.where(noise[:, t], random[:, t], (seq[:, t] * 3 + 1) % vocab)
    return seq[:, :-1], seq[:, 1:]


def verify_same_flags_across_ranks(args):
    """Every rank must run with the same flags (a rank with another --lr would train on silently):
    one all_gather_object of the parsed flags, then every rank exits naming the first that differs
    and each rank's value. As examples/common/flag_agreement.h does for the C++ examples."""
    mine = vars(args)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for name in sorted(mine):
        values = [ranks_flags.get(name) for ranks_flags in every]
        if any(v != values[0] for v in values):
            each = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            sys.exit(f"train.py (rank {dist.get_rank()}): the command-line flags differ across the ranks: "
                     f"'--{name.replace('_', '-')}' is {each}. Start every rank with the same flags (torchrun does)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--distributed-optimizer", action="store_true")
    parser.add_argument("--log-file")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--grad-reduce-in-bf16", action="store_true")
    args = parser.parse_args()
    if args.grad_reduce_in_bf16 and args.dtype != "bf16":
        parser.error("--grad-reduce-in-bf16 needs --dtype bf16 (fp32 params already reduce in fp32)")
    if args.dtype == "bf16" and args.tp > 1 and not args.grad_reduce_in_bf16:
        parser.error(f"--dtype bf16 at --tp {args.tp} needs --grad-reduce-in-bf16: torch's TP makes the params "
                     "DTensors, whose .grad must be a view of meshddp's buffer in the param's dtype (fp32 main "
                     "grads are not supported for DTensor params); or run at --tp 1")
    torch.set_num_threads(max(1, os.cpu_count() // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("gloo")
    verify_same_flags_across_ranks(args)
    if args.dp * args.tp != dist.get_world_size() or args.global_batch % args.dp:
        sys.exit(f"--dp {args.dp} x --tp {args.tp} must equal WORLD_SIZE ({dist.get_world_size()}) and "
                 f"--global-batch {args.global_batch} divide by --dp")
    mesh = init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))

    torch.manual_seed(args.seed)  # every rank builds the whole model; parallelize_module keeps its shards
    bf16 = args.dtype == "bf16"
    model = Gpt().to(torch.bfloat16 if bf16 else torch.float32)  # before TP: every layout holds the same values
    if args.tp > 1:  # at --tp 1 the params stay plain tensors (DTensor params cannot take fp32 main grads)
        parallelize_module(model, mesh["tp"], tp_plan(len(model.blocks)))
    config = meshddp.DdpConfig(use_distributed_optimizer=args.distributed_optimizer,
                               grad_reduce_in_fp32=bf16 and not args.grad_reduce_in_bf16)
    ddp = meshddp.DistributedDataParallel(model, mesh, "dp", config)
    masters = None  # plain DDP in bf16: (name, param, fp32 master) for AdamW to step
    if args.distributed_optimizer:
        optimizer = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="adamw", lr=args.lr))
    elif bf16:
        masters = [(n, p, p.detach().float().requires_grad_(True)) for n, p in model.named_parameters()]
        optimizer = torch.optim.AdamW([m for _, _, m in masters], lr=args.lr, weight_decay=0.0)
    else:
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.0)

    rank0 = dist.get_rank() == 0
    log = open(args.log_file, "w") if args.log_file and rank0 else sys.stdout
    if rank0:
        print(f"# python gpt: dp {args.dp} x tp {args.tp}{', ZeRO-1' if args.distributed_optimizer else ''}, "
              f"{sum(p.numel() for p in ddp.parameters())} params, global batch {args.global_batch}", file=sys.stderr)
        grads = "bf16 (reduced in bf16)" if args.grad_reduce_in_bf16 else "fp32 (reduced in fp32)"
        where = "this rank's ZeRO-1 shard" if args.distributed_optimizer else "a whole copy"
        print(f"# dtypes: params {args.dtype}, activations {args.dtype}, main grads {grads if bf16 else 'fp32'}"
              f"{f', masters fp32 ({where})' if bf16 else ''}, optimizer state fp32", file=sys.stderr)
    dp_rank, local = mesh.get_local_rank("dp"), args.global_batch // args.dp
    for step in range(args.steps):
        start = time.perf_counter()
        ids, targets = make_batch(64, 16, args.seed, step, args.global_batch)
        ids, targets = ids[dp_rank * local:(dp_rank + 1) * local], targets[dp_rank * local:(dp_rank + 1) * local]
        ddp.zero_grad_buffer()
        logits = ddp(ids)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))  # in fp32
        loss.backward()
        if args.distributed_optimizer:
            optimizer.step()  # finishes the grad sync itself
        else:
            ddp.finish_grad_sync()
            if masters:  # each master's grad: the fp32 main grad itself, or the bf16 .grad (a DTensor) widened
                for name, p, m in masters:
                    m.grad = p.grad.float() if p.grad is not None else ddp.main_grad(name).float()
            optimizer.step()
            if masters:
                with torch.no_grad():
                    for _, p, m in masters:
                        p.copy_(m)
        total = loss.detach().double().reshape(1) / args.dp
        dist.all_reduce(total, group=mesh.get_group("dp"))
        if rank0:
            print(f"step {step} loss {total.item():#.10g}", file=log, flush=True)
            print(f"[dp {args.dp} x tp {args.tp}] step {step + 1}/{args.steps}  loss {total.item():.4f}  "
                  f"{(time.perf_counter() - start) * 1e3:.0f} ms", file=sys.stderr)
    if args.distributed_optimizer:
        optimizer.finish_param_sync()  # the last step's param all-gathers, before their group goes away
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without finalizing the interpreter, as a multiprocessing worker does (os._exit after its
    # target returns). Gloo's worker threads may still be dropping their reference to a tensor of the
    # last collective (the loss all-reduce above, a TP collective) when the interpreter finalizes;
    # that drop needs the GIL, a thread that takes the GIL during finalization is ended mid-C++, and
    # the process dies in std::terminate (exit -6) after a clean run: docs/guide/python.md "Exiting".
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
