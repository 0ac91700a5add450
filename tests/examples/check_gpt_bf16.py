"""Runs examples/02_dp_x_tp_gpt in bf16 (--dtype bf16: bf16 params and activations, fp32 masters)
under torchrun and holds every distributed loss curve to the bf16 golden: the same model in one
process, same dtypes, fp32 masters, whole global batch. Usage:
check_gpt_bf16.py <gpt_example> {fp32-main-grads|bf16-main-grads|checkpoint|muon|pipeline|
pipeline-bf16-main-grads}.

The floor: bf16 rounds every activation and every gradient a layer hands on, so two one-process runs
that differ only in the order of the sums (the global batch in 2 or 4 micro-batches instead of 1:
each micro-batch's bf16 gradient rounded apart, then accumulated) drift apart by far more than fp32's
~1e-7. FLOOR is the largest relative loss difference of those runs to the golden, measured here on
every run; a distributed curve (a DP mean of bf16 gradients rounded per rank, TP partial sums, CP
slices, experts moved by all-to-all) must stay within MULTIPLE x FLOOR of it. A dense TP run is held
to the larger of FLOOR and TP's own rounding, measured at dp 1 x tp 2 and itself bounded
(with_tp_floor).

fp32-main-grads (the default, Megatron's grad_reduce_in_fp32): dp 2; dp 2 x tp 2 with sequence
parallel; dp 2 x cp 2 x tp 2 with 4 experts (top-2), EP 2 and ZeRO-1 (8 ranks; its golden and floor
are the MoE model's). bf16-main-grads: the same runs with --grad-reduce-in-bf16 (main grads
accumulated and reduced in bf16), against the floor of one-process runs that also accumulate in bf16
(a wider floor). checkpoint: dp 2 x tp 2 ZeRO-1 in bf16 saves at step 4; resumed at the same mesh it
repeats steps 4..7 bit for bit; resumed at dp 4 and at dp 1 it stays within the floor (the masters
themselves load bit for bit: tests/plugin/bf16_checkpoint_test.cpp). muon: --optimizer muon with
ZeRO-1 (Muon's matrices and AdamW's rest stepped on fp32 masters), dp 2, dp 2 x tp 2 and pp 2.

pipeline (--pp, 4 layers): pp 2 (1F1B, 4 micro-batches, plain DDP with an Fp32MasterParams per chunk),
pp 2 x vpp 2 (interleaved) and dp 2 x pp 2 with ZeRO-1 (a DistributedOptimizer per chunk), which saves
at step 4 and, resumed there, repeats steps 4..7 bit for bit; the header must also show the p2p buffers
in bf16. pipeline-bf16-main-grads: dp 2 x pp 2 ZeRO-1 with --grad-reduce-in-bf16, held to the floor of
one-process runs that also accumulate in bf16. The golden of a pipeline run is the plain one-process
run on the whole batch (--micro-batches 1), and its floor the usual one, not the one-process run with
the pipeline's micro-batches: that run is no closer (measured: pp 2 with 4 micro-batches is 2.7e-4
from the whole-batch golden and 3.2e-4 from the one-process 4-micro-batch run, 4.9e-4 from the
2-micro-batch one), since the tied embedding's gradient is summed in fp32 across the first and last
stage where one process lets autograd add its two uses in bf16; and a pipeline is a micro-batched run,
which is exactly what the floor measures.

Measured (8 steps, 2-core CPU; printed on every run; table in docs/reference/examples.md "bf16"): floors 3.6e-4
(dense) and 1.1e-3 (MoE) with fp32 main grads, 5.4e-4 and 7.3e-4 with bf16 ones; the distributed
runs at 0.53x-1.51x their floor. A curve this short cannot tell a bf16 reduction from an fp32 one
(dp 2 reduced in bf16 sits at 0.96x the fp32 floor), so every run's step-log header, read from the
buffers and the DDP's config, must also show the dtypes asked for. Broken on purpose: the example
reducing in bf16 while --dtype bf16 asks for fp32 main grads (and the reverse) fails both main-grad
modes at the golden's header; the 8-rank run without context parallelism in attention (each CP rank
attending to its own slice) is 5.4e-2 from the MoE golden, 17x the floor's limit."""
import sys
import tempfile

from torchrun_losses import expect_curve_close, expect_decreasing, run_losses

binary, mode = sys.argv[1], sys.argv[2]
STEPS = 8
MULTIPLE = 3
TP_MULTIPLE = 10
MOE = ["--experts", "4", "--top-k", "2"]
BF16 = ["--dtype", "bf16", "--global-batch", "16", "--seed", "1"]
LAYERS = ("--layers", "4")  # the pipeline modes' model: pp 2 x vpp 2 gives each chunk one block


def losses(dp=1, tp=1, cp=1, *extra, first=0, steps=STEPS, pp=1):
    """The run's loss curve; its step-log header must show the dtypes the flags ask for, read from
    the buffers (examples/common/precision.h): bf16 params, main grads fp32 (bf16 with
    --grad-reduce-in-bf16), fp32 masters (ZeRO-1's shard or plain DDP's whole copy); on a pipeline
    (pp > 1) also the p2p buffers' dtype, bf16."""
    grads = "bf16" if "--grad-reduce-in-bf16" in extra else "fp32"
    masters = "this rank's ZeRO-1 shard" if "--distributed-optimizer" in extra else "a whole copy"
    header = f"# dtypes: params bf16, activations bf16, main grads {grads} (reduced in {grads}), masters fp32 ({masters}"
    expected = [header] + (["optimizer state fp32, p2p bf16\n"] if pp > 1 else [])
    mesh = ["--dp", str(dp), "--cp", str(cp), "--tp", str(tp)] + (["--pp", str(pp)] if pp > 1 else [])
    return run_losses(binary, dp * cp * tp * pp, steps, [*mesh, *BF16, *extra], first=first,
                      expect_in_stderr=expected)


def worst(reference, curve):
    return max(abs(a - b) / abs(a) for a, b in zip(reference, curve))


def golden_and_floor(name, *extra):
    """The one-process golden and its floor: the largest relative difference of the 2- and
    4-micro-batch runs to it."""
    golden = losses(1, 1, 1, *extra)
    print(f"{name + ' golden':34s}:", golden)
    expect_decreasing(golden)
    floor = max(worst(golden, losses(1, 1, 1, *extra, "--micro-batches", str(k))) for k in (2, 4))
    print(f"{name + ' floor':34s}: {floor:.2e} (one process, 1 vs 2 and 4 micro-batches)")
    if floor == 0:
        sys.exit(f"FAILED: {name}: micro-batching changed no loss bit: is the run really in bf16?")
    return golden, floor


def with_tp_floor(name, golden, floor, *extra):
    """The floor of a TP run. TP splits the forward's sums (partial products added in bf16 across TP
    ranks), which micro-batching does not, so a TP curve's own rounding is measured too: the same
    model at dp 1 x tp 2 (TP alone; meshddp's DP reduction not involved). Over seeds 1-3 that run sat
    at 2.5-7.8x the micro-batch floor (AdamW and Muon alike), and dp 2 x tp 2 within 1.3x of it. The
    TP run itself must stay within TP_MULTIPLE x the micro-batch floor, so that a TP error cannot
    widen the floor it is held to (TP's exactness is checked in fp32: check_gpt_muon.py, dp 2 x tp 2)."""
    tp = worst(golden, losses(1, 2, 1, *extra))
    print(f"{name + ' TP floor':34s}: {tp:.2e} (dp 1 x tp 2) = {tp / floor:.2f} x the micro-batch floor "
          f"(limit {TP_MULTIPLE})")
    if tp > TP_MULTIPLE * floor:
        sys.exit(f"FAILED: {name}: the dp 1 x tp 2 run is {tp:.2e} from the one-process golden, more than "
                 f"{TP_MULTIPLE} x the micro-batch floor {floor:.2e}")
    return max(floor, tp)


def check(name, golden, floor, curve, first=0):
    expect_curve_close(golden[first:], curve, MULTIPLE * floor, name, reference_name="one process", first=first)
    print(f"{'':34s}  = {worst(golden[first:], curve) / floor:.2f} x the floor (limit {MULTIPLE})")


if mode in ("fp32-main-grads", "bf16-main-grads"):
    reduce = ["--grad-reduce-in-bf16"] if mode == "bf16-main-grads" else []
    golden, floor = golden_and_floor("dense", *reduce)
    check("dp2", golden, floor, losses(2, 1, 1, *reduce))
    sp = ("--sequence-parallel", *reduce)
    check("dp2 x tp2 sequence parallel", golden, with_tp_floor("dense", golden, floor, *sp), losses(2, 2, 1, *sp))
    moe_golden, moe_floor = golden_and_floor("moe", *MOE, *reduce)
    check("dp2 x cp2 x tp2 ep2 ZeRO-1", moe_golden, moe_floor,
          losses(2, 2, 2, *MOE, "--ep", "2", "--distributed-optimizer", *reduce))
elif mode == "checkpoint":
    golden, floor = golden_and_floor("dense ZeRO-1", "--distributed-optimizer")
    with tempfile.TemporaryDirectory() as checkpoints:
        saved = ("--distributed-optimizer", "--save-dir", checkpoints, "--save-every", "4")
        uninterrupted = losses(2, 2, 1, *saved)
        check("dp2 x tp2 ZeRO-1", golden, floor, uninterrupted)
        resumed = losses(2, 2, 1, *saved, "--resume-step", "4", first=4)
        print(f"{'dp2 x tp2 resumed@4':34s}:", resumed)
        if resumed != uninterrupted[4:]:
            sys.exit(f"FAILED: resuming the bf16 dp2 x tp2 run at step 4 gave {resumed}, not {uninterrupted[4:]}")
        check("resumed@4 at dp4", golden, floor, losses(4, 1, 1, *saved, "--resume-step", "4", first=4), first=4)
        check("resumed@4 at dp1", golden, floor, losses(1, 1, 1, *saved, "--resume-step", "4", first=4), first=4)
elif mode == "muon":
    muon = ("--optimizer", "muon", "--distributed-optimizer")
    golden, floor = golden_and_floor("dense Muon", *muon)
    check("dp2 Muon", golden, floor, losses(2, 1, 1, *muon))
    check("dp2 x tp2 Muon", golden, with_tp_floor("dense Muon", golden, floor, *muon), losses(2, 2, 1, *muon))
    check("pp2 Muon, 4 micro-batches", golden, floor, losses(1, 1, 1, *muon, "--micro-batches", "4", pp=2))
elif mode == "pipeline":
    golden, floor = golden_and_floor("dense 4 layers", *LAYERS)
    layers = LAYERS
    check("pp2 1F1B, 4 micro-batches", golden, floor, losses(1, 1, 1, *layers, "--micro-batches", "4", pp=2))
    check("pp2 x vpp2 interleaved", golden, floor,
          losses(1, 1, 1, *layers, "--vpp", "2", "--micro-batches", "4", pp=2))
    with tempfile.TemporaryDirectory() as checkpoints:
        zero1 = (*layers, "--micro-batches", "2", "--distributed-optimizer", "--save-dir", checkpoints,
                 "--save-every", "4")
        uninterrupted = losses(2, 1, 1, *zero1, pp=2)
        check("dp2 x pp2 ZeRO-1", golden, floor, uninterrupted)
        resumed = losses(2, 1, 1, *zero1, "--resume-step", "4", first=4, pp=2)
        print(f"{'dp2 x pp2 ZeRO-1 resumed@4':34s}:", resumed)
        if resumed != uninterrupted[4:]:
            sys.exit(f"FAILED: resuming the bf16 dp2 x pp2 ZeRO-1 run at step 4 gave {resumed}, "
                     f"not {uninterrupted[4:]}")
elif mode == "pipeline-bf16-main-grads":
    reduce = (*LAYERS, "--grad-reduce-in-bf16")
    golden, floor = golden_and_floor("dense 4 layers bf16 main grads", *reduce)
    check("dp2 x pp2 ZeRO-1 bf16 main grads", golden, floor,
          losses(2, 1, 1, *reduce, "--micro-batches", "2", "--distributed-optimizer", pp=2))
else:
    sys.exit("usage: check_gpt_bf16.py <gpt_example> fp32-main-grads|bf16-main-grads|checkpoint|muon|pipeline|"
             f"pipeline-bf16-main-grads (got '{mode}')")
print("1 passed, 0 failed")
