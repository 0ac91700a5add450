"""Workers for test_bf16.py: a HuggingFace-style causal LM (a config object, `model(input_ids,
labels=...)` returning an output with `.loss` and `.logits`, RMSNorm, SwiGLU MLP, rotary-free
attention, tied lm_head; written here because transformers is not installed) trained in bf16 under
meshddp's DDP (grad_reduce_in_fp32) and ZeRO-1 DistributedOptimizer (fp32 masters), and the golden:
the same bf16 model in one process with an fp32 master copy stepped by torch.optim.AdamW (the way
torch users do mixed precision by hand, Megatron's Float16OptimizerWithFloat16Params)."""
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import meshddp

STEPS, BATCH, LR = 8, 16, 1e-2


@dataclass
class TinyLlamaConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    intermediate_size: int = 64
    num_attention_heads: int = 4
    num_hidden_layers: int = 2
    max_position_embeddings: int = 16
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02


@dataclass
class CausalLMOutput:
    loss: torch.Tensor
    logits: torch.Tensor


class RMSNorm(torch.nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):  # in fp32, then back to the input's dtype, as HF's LlamaRMSNorm
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads = c.num_attention_heads
        self.q_proj = torch.nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        self.k_proj = torch.nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        self.v_proj = torch.nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        self.o_proj = torch.nn.Linear(c.hidden_size, c.hidden_size, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        split = lambda h: h.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        y = F.scaled_dot_product_attention(split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x)),
                                           is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d))


class DecoderLayer(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.gate_proj = torch.nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = torch.nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = torch.nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyLlamaForCausalLM(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.config = c
        self.embed_tokens = torch.nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_positions = torch.nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.layers = torch.nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = torch.nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.apply(self._init_weights)

    def _init_weights(self, module):  # as HF's PreTrainedModel: N(0, initializer_range)
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, std=self.config.initializer_range)

    def forward(self, input_ids, labels=None):
        positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
        h = self.embed_tokens(input_ids) + self.embed_positions(positions)
        for layer in self.layers:
            h = layer(h)
        logits = self.lm_head(self.norm(h))
        loss = None
        if labels is not None:  # in fp32, as HF's loss (logits.float())
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return CausalLMOutput(loss=loss, logits=logits)


def make_batch(step):
    """A learnable "next token = 3 * token + 1 (mod vocab)" language with 10% noise."""
    gen = torch.Generator().manual_seed(1000 + step)
    seq = torch.empty(BATCH, 17, dtype=torch.long)
    seq[:, 0] = torch.randint(64, (BATCH,), generator=gen)
    noise = torch.rand(BATCH, 16, generator=gen) < 0.1
    random = torch.randint(64, (BATCH, 16), generator=gen)
    for t in range(16):
        seq[:, t + 1] = torch.where(noise[:, t], random[:, t], (seq[:, t] * 3 + 1) % 64)
    return seq[:, :-1], seq[:, 1:]


def bf16_model():
    torch.manual_seed(0)
    return TinyLlamaForCausalLM(TinyLlamaConfig()).to(torch.bfloat16)


def golden(micro_batches):
    """One process, whole batch in `micro_batches` pieces: bf16 params and activations, each
    micro-batch's bf16 gradient added into an fp32 gradient, AdamW on fp32 masters, params = bf16(masters)."""
    model = bf16_model()
    params = list(model.parameters())
    masters = [p.detach().float().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=0.0, foreach=False)
    losses = []
    for step in range(STEPS):
        ids, labels = make_batch(step)
        for m in masters:
            m.grad = torch.zeros_like(m)
        total = 0.0
        for ids_m, labels_m in zip(ids.chunk(micro_batches), labels.chunk(micro_batches)):
            loss = model(ids_m, labels=labels_m).loss / micro_batches
            loss.backward()
            total += loss.item()
            for p, m in zip(params, masters):
                m.grad += p.grad.float()
                p.grad = None
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        losses.append(total)
    return losses


def meshddp_bf16(rank, world_size, grad_reduce_in_fp32=True):
    """The bf16 model under meshddp DDP + ZeRO-1 on `world_size` DP ranks, each on its rows of the
    global batch; every rank returns the global loss curve. Rank 0 also returns the goldens."""
    model = bf16_model()
    config = meshddp.DdpConfig(bucket_bytes=4096, use_distributed_optimizer=True,
                               grad_reduce_in_fp32=grad_reduce_in_fp32)
    ddp = meshddp.DistributedDataParallel(model, process_group=dist.group.WORLD, config=config)
    opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="adamw", lr=LR, weight_decay=0.0))
    main_grad_dtype = ddp.main_grad("layers.0.gate_proj.weight").dtype
    losses = []
    for step in range(STEPS):
        ids, labels = make_batch(step)
        rows = lambda t: t.chunk(world_size)[rank]  # noqa: E731
        ddp.zero_grad_buffer()
        loss = ddp(rows(ids), labels=rows(labels)).loss
        loss.backward()
        opt.step()
        total = loss.detach().double().reshape(1) / world_size
        dist.all_reduce(total)
        losses.append(total.item())
    opt.finish_param_sync()
    out = {"losses": losses, "main_grad_dtype": main_grad_dtype,
           "param_dtype": next(model.parameters()).dtype}
    if rank == 0:
        out["golden"] = {k: golden(k) for k in (1, 2, 4)}
    return out
