"""Per-rank bodies of tests/python/test_pipelining_tied.py: a toy language model split into 2 stages
(the token embedding on the first, the LM head tied to it on the last) run by torch's Schedule1F1B over
dp 2 x pp 2 (4 ranks), each stage a meshddp.DistributedDataParallel inside a
meshddp.pipelining.PipelineStage. Golden: the tied model in one process on the global batch, plain SGD
(every rank computes it)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed import pipelining as tpp

import meshddp
import meshddp.pipelining
# The toy stages of the pipeline controls' tests: the embedding and a layer first, a layer and the LM
# head last (registered after fc1, so first in its stage's buffer layout: the tied copies sit at
# different offsets of the two stages' layouts).
from pipeline_workers import Stage0 as First, Stage1 as Last

VOCAB, HIDDEN, SEQ, LOCAL_BATCH, MICRO, STEPS, LR = 16, 8, 4, 8, 4, 3, 0.5


def batch(step, dp_size, ignore):
    """Tokens and labels of the global batch; with `ignore`, ~40% of the labels are -100 (ignored), so
    the DP ranks hold different counts of valid tokens."""
    g = torch.Generator().manual_seed(3110 + step)
    rows = LOCAL_BATCH * dp_size
    tokens = torch.randint(VOCAB, (rows, SEQ), generator=g)
    labels = torch.randint(VOCAB, (rows, SEQ), generator=g)
    if ignore:
        labels[torch.rand(rows, SEQ, generator=g) < 0.4] = -100
    return tokens, labels


def golden(dp_size, per_token):
    """The tied model in one process, the mean cross-entropy over the global batch's valid tokens;
    returns [wte, fc0.weight, fc0.bias, fc1.weight, fc1.bias] after STEPS steps."""
    first, last = First(), Last()
    params = [first.wte.weight, first.fc0.weight, first.fc0.bias, last.fc1.weight, last.fc1.bias]
    opt = torch.optim.SGD(params, lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        tokens, labels = batch(step, dp_size, per_token)
        logits = F.linear(torch.tanh(last.fc1(first(tokens))), first.wte.weight)
        F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100).backward()
        opt.step()
    return [p.detach() for p in params]


def tied_pipeline(rank, world_size, zero1=False, per_token=False, comm_hook="none", group_from_mesh=False,
                  broken=None):
    """Returns (max |param - golden| over this stage's params after STEPS steps, whether the tied copies
    were bit-identical after every step). per_token: torchtitan's loss, the sum over a micro-batch's
    valid tokens divided by the global count of valid tokens (summed over the DP group before the step),
    scale_grads=False and grad_reduction="sum"; else a mean loss per micro-batch, scale_grads=True.
    group_from_mesh: no embedding_group= given (the DDP makes it from the mesh's "pp" dim).
    broken (on purpose): "no_tie" (the copies neither declared tied nor summed), "mean_reduction"
    (per_token with the DP mean kept)."""
    dp_size, pp_size = 2, 2
    mesh = init_device_mesh("cpu", (dp_size, pp_size), mesh_dim_names=("dp", "pp"))
    dp_rank, pp_rank = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    groups = [dist.new_group(ranks) for ranks in meshddp.groups.embedding_groups([dp_size, pp_size], ["dp", "pp"])]
    embedding = groups[dp_rank]  # [[0, 1], [2, 3]]: this rank's pipeline's first and last stage
    module = First() if pp_rank == 0 else Last()
    if broken != "no_tie":
        meshddp.declare_tied_across_stages(module.wte.weight if pp_rank == 0 else module.lm_head.weight)
    else:  # each copy its own weight: the last stage's starts from the first stage's values
        if pp_rank == 1:
            module.lm_head.weight.data.copy_(First().wte.weight)
    config = meshddp.DdpConfig(bucket_bytes=64, use_distributed_optimizer=zero1, comm_hook=comm_hook)
    given = {} if group_from_mesh else {"embedding_group": None if broken == "no_tie" else embedding}
    ddp = meshddp.DistributedDataParallel(module, mesh, "dp", config=config, **given)
    reduction = "sum" if per_token and broken != "mean_reduction" else "mean"
    stage = meshddp.pipelining.PipelineStage(ddp, pp_rank, pp_size, torch.device("cpu"),
                                             group=mesh["pp"].get_group(), grad_reduction=reduction)
    count = torch.zeros(1)  # this step's global count of valid tokens (per_token), set before each step

    def loss_fn(logits, labels):
        if per_token:
            return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100,
                                   reduction="sum") / count
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))

    sched = tpp.Schedule1F1B(stage, MICRO, loss_fn=loss_fn, scale_grads=not per_token)
    opt = (meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="sgd", lr=LR)) if zero1
           else torch.optim.SGD(list(ddp.parameters()), lr=LR))
    identical = True
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        tokens, labels = batch(step, dp_size, per_token)
        tokens, labels = tokens.chunk(dp_size)[dp_rank], labels.chunk(dp_size)[dp_rank]
        count = (labels != -100).sum().float().reshape(1)
        dist.all_reduce(count, group=mesh["dp"].get_group())  # torchtitan: over the batch mesh
        if pp_rank == 0:
            sched.step(tokens)
        else:
            sched.step(target=labels)
        meshddp.pipelining.finalize_model_grads(stage)
        opt.step()
        if broken != "no_tie":
            ddp.check_tied_params_identical()  # raises on both ends when the copies differ
        else:
            identical = identical and _copies_identical(module, pp_rank, embedding)
    want = golden(dp_size, per_token)
    got = ([module.wte.weight, module.fc0.weight, module.fc0.bias] if pp_rank == 0 else
           [module.lm_head.weight, None, None, module.fc1.weight, module.fc1.bias])
    diff = max((g.detach() - w).abs().max().item() for g, w in zip(got, want) if g is not None)
    return diff, identical


def _copies_identical(module, pp_rank, embedding):
    """Both ends' copies compared bit for bit (the broken run has no tied declaration to check them)."""
    mine = (module.wte.weight if pp_rank == 0 else module.lm_head.weight).detach().clone()
    both = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(both, mine, group=embedding)
    return bool(torch.equal(both[0], both[1]))
