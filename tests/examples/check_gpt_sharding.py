"""Runs examples/02_dp_x_tp_gpt under each data-parallel sharding strategy (--data-parallel-sharding-strategy,
docs/guide/sharding.md) and checks the final params (the last checkpoint, consolidated) against one process
on the whole global batch and against the 'optim' strategy's run at the same mesh. One case per call:

  dp2_dp4     dp 2 with 2 micro-batches (each micro-batch reduce-scattered into the shards under
              optim_grads), dp 4 without accumulation
  dp2_tp2     dp 2 x tp 2, sequence parallel, 2 micro-batches
  muon        dp 2, Muon on whole-param shards (shard_policy whole_param: each matrix on one rank)
  experts     dp 4 with 4 experts over EP 2 (expert buckets reduce-scattered over expert-DP)

SGD (lr 2; Muon: its own lr): a gradient off by a scale or a missing micro-batch shows in the params.
optim_grads vs optim: without accumulation the reduce-scatter is the same and the shard is 0 + it, so the
params are bit-identical; with k micro-batches the k reduce-scattered means are summed in the shard instead
of summed before one reduce-scatter, which reorders fp32 sums: atol 5e-7 (measured 6e-8 at dp 2; printed). Against one
process: atol 5e-7 as well (measured 1.2e-7-1.8e-7: DP means and TP partial sums split fp32 sums; Muon 1e-3, below). The run's
gradient storage (printed by the example on rank 0: shards plus pool blocks) must be below the optim run's
whole buffer, and at dp 4 below 0.6 of it (expected: 1/4 + two blocks of ~17 KB = 0.55; measured: printed),
which a whole buffer kept resident beside the shards could not be.
~20-40 s per case on 2 loaded cores."""
import os
import re
import sys
import tempfile

import torch

from torchrun_losses import run_losses

from meshddp import consolidate  # noqa: E402  (the engine's checkpoint reader)

binary, case = sys.argv[1], sys.argv[2]
STEPS = 4
ATOL = 5e-7

# 4 KiB buckets: the model (~28k params, 115 KB of fp32 gradients) spans many, each about one param (the
# largest, an MLP matrix, 16 KiB), so the pool of two blocks is well below the whole buffer (with one
# bucket a block would be the whole buffer).
MODEL = ["--layers", "2", "--global-batch", "16", "--seed", "1", "--optimizer", "sgd", "--lr", "2",
         "--bucket-bytes", "4096"]
MUON = ["--layers", "2", "--global-batch", "16", "--seed", "1", "--optimizer", "muon", "--lr", "0.01",
        "--bucket-bytes", "4096"]
MOE = ["--experts", "4", "--top-k", "2"]
# Muon against one process: its Newton-Schulz iterations amplify the split fp32 sums; optim's own run
# differs from one process by the same 5.3e-4 (measured), optim_grads equalling it bit for bit.
MUON_ATOL = 1e-3
# name: [(nproc, flags, one-process flags, atol to one process, gradient storage limit as a fraction of
# optim's whole buffer)]. experts: two flat buffers (dense, expert), each with its pool, the expert
# shards 1/2 (expert-DP 2): only below the whole buffer.
CASES = {
    "dp2_dp4": [(2, ["--dp", "2", "--micro-batches", "2", *MODEL], MODEL, ATOL, 1.0),
                (4, ["--dp", "4", *MODEL], MODEL, ATOL, 0.6)],
    "dp2_tp2": [(4, ["--dp", "2", "--tp", "2", "--sequence-parallel", "--micro-batches", "2", *MODEL], MODEL, ATOL,
                 1.0)],
    "muon": [(2, ["--dp", "2", *MUON], [*MUON, "--distributed-optimizer"], MUON_ATOL, 1.0)],
    "experts": [(4, ["--dp", "4", "--ep", "2", *MOE, *MODEL], [*MOE, *MODEL], ATOL, 1.0)],
}
if case not in CASES:
    sys.exit(f"FAILED: unknown case '{case}'; one of {', '.join(CASES)}")


def final_params(nproc, args, save_dir):
    _, err = run_losses(binary, nproc, STEPS, [*args, "--save-dir", save_dir], with_stderr=True)
    found = re.search(r"# gradient storage on rank 0: (\d+) bytes", err)
    params, _ = consolidate.consolidate(save_dir, STEPS)
    return params, int(found.group(1)) if found else None


def worst_difference(want, got, name):
    worst = 0.0
    for key, ref in want.items():
        if key not in got:
            sys.exit(f"FAILED: {name}: the final checkpoint has no '{key}'")
        worst = max(worst, (got[key] - ref).abs().max().item())
    return worst


with tempfile.TemporaryDirectory() as tmp:
    for n, (nproc, args, reference_args, one_atol, limit) in enumerate(CASES[case]):
        reference, _ = final_params(1, ["--dp", "1", *reference_args], os.path.join(tmp, f"one{n}"))
        optim, optim_bytes = final_params(nproc, [*args, "--data-parallel-sharding-strategy", "optim"],
                                          os.path.join(tmp, f"optim{n}"))
        grads, grads_bytes = final_params(nproc, [*args, "--data-parallel-sharding-strategy", "optim_grads"],
                                          os.path.join(tmp, f"optim_grads{n}"))
        accumulates = "--micro-batches" in args
        to_optim = worst_difference(optim, grads, case)
        to_one = worst_difference(reference, grads, case)
        print(f"{case} [{' '.join(args[:args.index('--global-batch')])}]: optim_grads vs optim max abs difference "
              f"{to_optim:.2e}, vs one process {to_one:.2e}; gradient storage on rank 0: {grads_bytes} bytes "
              f"(optim {optim_bytes})")
        if not accumulates and to_optim != 0.0:
            sys.exit(f"FAILED: {case}: without accumulation optim_grads must equal optim bit for bit, differs by {to_optim}")
        if to_optim > ATOL or to_one > one_atol:
            sys.exit(f"FAILED: {case}: optim_grads' final params differ from optim's by {to_optim} (atol {ATOL}) and "
                     f"from one process's by {to_one} (atol {one_atol})")
        if grads_bytes is None or optim_bytes is None or grads_bytes >= limit * optim_bytes:
            sys.exit(f"FAILED: {case}: optim_grads holds {grads_bytes} bytes of gradients on rank 0, not below "
                     f"{limit} x optim's {optim_bytes} (the whole buffer stayed resident?)")
print("1 passed, 0 failed")
