"""Per-rank bodies of tests/python/test_pipeline.py: a 2-stage toy pipeline (dp 1 x pp 2) driven
from Python with meshddp's pipeline controls: stage 0 holds the token embedding, stage 1 the LM head
tied to it; activations go by torch.distributed send/recv; per-token loss normalised by
meshddp.finalize_model_grads. Golden: the tied model in one process (every rank runs it)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import meshddp

VOCAB, HIDDEN, BATCH, SEQ, MICRO, STEPS, LR = 16, 8, 4, 4, 2, 3, 0.5


class Stage0(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(21)
        self.wte = torch.nn.Embedding(VOCAB, HIDDEN)
        self.fc0 = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, tokens):
        return torch.tanh(self.fc0(self.wte(tokens)))


class Stage1(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(22)
        self.fc1 = torch.nn.Linear(HIDDEN, HIDDEN)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, h):
        return self.lm_head(torch.tanh(self.fc1(h)))


def batch(step):
    g = torch.Generator().manual_seed(900 + step)
    tokens = torch.randint(VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(VOCAB, (BATCH, SEQ), generator=g)
    labels[torch.rand(BATCH, SEQ, generator=g) < 0.3] = -100
    return tokens, labels


def golden():
    s0, s1 = Stage0(), Stage1()
    params = [s0.wte.weight, s0.fc0.weight, s0.fc0.bias, s1.fc1.weight, s1.fc1.bias]
    opt = torch.optim.SGD(params, lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        tokens, labels = batch(step)
        logits = F.linear(torch.tanh(s1.fc1(s0(tokens))), s0.wte.weight)
        F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100).backward()
        opt.step()
    return [p.detach() for p in params]


def tied_pipeline(rank, world_size):
    """Returns this stage's max |param - golden| after STEPS steps, and whether the tied check passed."""
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "pp"))
    embedding = dist.new_group([0, 1])
    stage = Stage0() if rank == 0 else Stage1()
    meshddp.declare_tied_across_stages(stage.wte.weight if rank == 0 else stage.lm_head.weight)
    ddp = meshddp.DistributedDataParallel(stage, mesh, "dp", embedding_group=embedding)
    opt = torch.optim.SGD(list(ddp.parameters()), lr=LR)
    ddp.check_tied_params_identical()  # the construction broadcast made stage 1's head stage 0's wte
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        tokens, labels = batch(step)
        sends = []  # isend: a blocking send would wait for a receive the other stage posts later
        if rank == 0:
            outs = []
            for m in range(MICRO):
                outs.append(ddp(tokens.chunk(MICRO)[m]))
                sends.append(dist.isend(outs[-1].detach().contiguous(), 1))
            for m in range(MICRO):
                grad = torch.empty_like(outs[m])
                dist.recv(grad, 1)
                ddp.set_requires_gradient_sync(False)
                outs[m].backward(grad)
            ddp.start_grad_sync()
            count = 0
        else:
            for m in range(MICRO):
                h = torch.empty(BATCH // MICRO, SEQ, HIDDEN)
                dist.recv(h, 0)
                h.requires_grad_(True)
                loss = F.cross_entropy(ddp(h).reshape(-1, VOCAB), labels.chunk(MICRO)[m].reshape(-1),
                                       ignore_index=-100, reduction="sum")
                with ddp.no_sync() if m < MICRO - 1 else torch.enable_grad():
                    loss.backward()
                sends.append(dist.isend(h.grad, 0))
            count = int((labels != -100).sum())
        for work in sends:
            work.wait()
        total = meshddp.finalize_model_grads([ddp], num_tokens=count, pp_group=dist.group.WORLD)
        assert total == int((labels != -100).sum()), total
        opt.step()
        ddp.check_tied_params_identical()
    want = golden()
    got = [stage.wte.weight, stage.fc0.weight, stage.fc0.bias] if rank == 0 else \
        [stage.lm_head.weight, None, None, stage.fc1.weight, stage.fc1.bias]
    diffs = [(g - w).abs().max().item() for g, w in zip(got, want) if g is not None]
    return max(diffs)
