"""docs/guide/python.md's quickstart block, run under torchrun (tests/docs/test_doc_snippets.py): the
names it leaves to the reader (dp, tp, MyModel, plan, steps, k, x, y, loss_fn) are given here, the
block's own lines follow in order. It checks that the loss falls and that every DP rank ends with
the same params."""
import os
import sys

import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel
import meshddp


class MyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


world = int(os.environ["WORLD_SIZE"])
tp = 2 if world % 2 == 0 and world > 2 else 1
dp = world // tp
plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
steps, k = 6, 2
loss_fn = torch.nn.functional.mse_loss
dp_rank = int(os.environ["RANK"]) // tp
g = torch.Generator().manual_seed(1)
data = torch.randn(k, 4 * dp, 8, generator=g), torch.randn(k, 4 * dp, 4, generator=g)
x, y = (t[:, 4 * dp_rank:4 * (dp_rank + 1)] for t in data)  # this DP rank's rows, every micro-batch
losses = []

dist.init_process_group("gloo")                        # torchrun's environment; "nccl" on GPUs
mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
model = MyModel()                                      # any torch.nn.Module
parallelize_module(model, mesh["tp"], plan)            # optional: torch's own TP (DTensor params)
ddp = meshddp.DistributedDataParallel(model, mesh, dp_dim="dp",
                                      config=meshddp.DdpConfig(bucket_bytes=40 << 20))
opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)

for step in range(steps):
    ddp.zero_grad_buffer()                  # not opt.zero_grad(): grads are views of the buffer
    for m in range(k):
        ddp.set_requires_gradient_sync(m == k - 1)     # or: `with ddp.no_sync():` for micro-batches 0..k-2
        loss_fn(ddp(x[m]), y[m]).div(k).backward() # buckets reduce over "dp" while backward runs
    ddp.finish_grad_sync()                  # every .grad now holds the DP mean
    opt.step()
    with torch.no_grad():
        losses.append(loss_fn(ddp(x[0]), y[0]).item())

assert losses[-1] < losses[0], losses
for p in model.parameters():
    local = p.to_local() if hasattr(p, "to_local") else p
    gathered = [torch.empty_like(local) for _ in range(dp)]
    dist.all_gather(gathered, local.detach().contiguous(), group=mesh["dp"].get_group())
    assert all(torch.equal(t, gathered[0]) for t in gathered), "DP ranks' params differ"
print(f"quickstart: rank {dist.get_rank()} ok, dp {dp} x tp {tp}, losses {losses[0]:.4f} -> {losses[-1]:.4f}")
dist.destroy_process_group()
sys.stdout.flush(), sys.stderr.flush()
os._exit(0)  # not a finalizing interpreter under live Gloo threads (docs/guide/python.md, "Exiting")
