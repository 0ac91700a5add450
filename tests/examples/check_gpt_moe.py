"""Runs examples/02_dp_x_tp_gpt with a dropless mixture of experts (--experts 4 --top-k 2) under
torchrun and checks every loss curve matches the one-process run (all experts local, whole global
batch, same seed). Usage: check_gpt_moe.py <gpt_example> {replicated|expert-parallel}.

replicated: every rank holds all experts (--ep 1): dp 2; dp 2 x tp 2 (each expert's fc1/fc2 split
over TP, the router replicated). expert-parallel: the experts spread over EP groups carved out of DP,
tokens moving by all-to-all: dp 4 with EP 2; dp 2 x tp 2 with EP 2 (expert gradients reduced over the
expert-data-parallel group: DdpConfig::expert_parallel_size).

Tolerance: rtol 1e-5 over 10 steps, as check_gpt_example.py: the runs differ only in how fp32 sums are
split (router and expert matmuls over fewer rows, DP means, TP partial sums), ~1e-7 per step. Measured
max relative differences (printed): 6.2e-8 (dp2), 1.2e-7 (dp2 x tp2). At EP 2 the step-0 loss (the
forward through the all-to-alls, before any gradient sync matters) differed from the one-process loss
by <= 5.7e-8 relative (dp2, dp4, dp2 x tp2, dp2 x cp2; measured with DDP's model-agreement checks
disabled by hand, before the expert-DP sync existed). Broken on purpose: a router normalised over the
batch (softmax over tokens, not experts) moves dp2's step 1 by 1.8e-4; received rows handed to the
local experts source-major instead of expert-major (tp::route_to_experts) moves EP 2's step 0 by
3.5e-4 (dp2) and 2.4e-4 (dp4)."""
import sys

from torchrun_losses import run_losses

binary, mode = sys.argv[1], sys.argv[2]
STEPS = 10
RTOL = 1e-5
MOE = ["--experts", "4", "--top-k", "2"]


def losses(dp, tp, ep, *extra):
    return run_losses(binary, dp * tp, STEPS, ["--dp", str(dp), "--tp", str(tp), "--ep", str(ep),
                                               "--global-batch", "16", "--seed", "1", *MOE, *extra])


def check(name, reference, curve):
    print(f"{name:20s}:", curve)
    worst = max(abs(a - b) / abs(a) for a, b in zip(reference, curve))
    print(f"{'':20s}  max relative difference to one process: {worst:.2e}")
    for s, (a, b) in enumerate(zip(reference, curve)):
        if abs(a - b) > RTOL * abs(a):
            sys.exit(f"FAILED: step {s}: loss {a} in one process vs {b} at {name} (rtol {RTOL})")


reference = losses(1, 1, 1)
print(f"{'one process':20s}:", reference)
if not reference[-1] < reference[0]:
    sys.exit(f"FAILED: the loss did not decrease: {reference[0]} -> {reference[-1]}")
if mode == "replicated":
    check("dp2", reference, losses(2, 1, 1))
    check("dp2 x tp2", reference, losses(2, 2, 1))
elif mode == "expert-parallel":
    check("dp4 ep2", reference, losses(4, 1, 2))
    check("dp2 x tp2 ep2", reference, losses(2, 2, 2))
else:
    sys.exit(f"usage: check_gpt_moe.py <gpt_example> replicated|expert-parallel (got '{mode}')")
print("1 passed, 0 failed")
