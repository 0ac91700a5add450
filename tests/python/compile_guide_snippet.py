"""The recipe of docs/guide/compile.md (its python block, line for line: test_compile.py checks), run on
each rank by test_compile.py with torch.compile's backend forced to aot_eager (inductor's C++ compiles
take minutes on CI's cores; the split is the same)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
import meshddp


def main(rank, world_size):
    with torch.compiler.set_stance("default", force_backend="aot_eager"):
        run_recipe()


def run_recipe():
    class Block(torch.nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.norm = torch.nn.LayerNorm(dim)
            self.up = torch.nn.Linear(dim, 4 * dim)
            self.down = torch.nn.Linear(4 * dim, dim)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(self.norm(x))))


    model = torch.nn.Sequential(*[Block(64) for _ in range(4)])
    config = meshddp.DdpConfig()
    config.bucket_bytes = 1 << 20
    ddp = meshddp.DistributedDataParallel(model, process_group=dist.group.WORLD, config=config)

    # Either: the whole wrapper, split at the bucket boundaries (torch._dynamo.config.optimize_ddp, on by default).
    compiled = torch.compile(ddp)
    # Or (torchtitan's way): each block, before or after wrapping; the wrapper itself stays eager.
    #     for block in model: block.compile()
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    for step in range(3):
        ddp.zero_grad_buffer()
        x = torch.randn(32, 64)
        F.mse_loss(compiled(x), x).backward()  # buckets reduce while the compiled backward runs
        ddp.finish_grad_sync()
        opt.step()
