"""docs/guide/python.md's ZeRO-1 block, run under torchrun (tests/docs/test_doc_snippets.py) in a
scratch directory given as argv[1]: the names it leaves to the reader (mesh, MyModel, steps, batch,
loss_fn) are given here, the block's own lines follow in order. It checks that the loss falls, that a
step reports its gradient norm, and that a freshly built model and optimizer loaded from the
checkpoint hold the saved params exactly."""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import meshddp


class MyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def batch(step):
    """This DP rank's rows: the same every step, so that the loss must fall."""
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


os.chdir(sys.argv[1])
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
torch.manual_seed(dist.get_rank())  # different on each rank: DDP broadcasts rank 0's
steps, loss_fn = 8, torch.nn.functional.mse_loss
losses = []

ddp = meshddp.DistributedDataParallel(MyModel(), mesh, dp_dim="dp",
                                      config=meshddp.DdpConfig(use_distributed_optimizer=True))
opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(
    lr=1e-2, weight_decay=0.01, groups=[("*.bias", None, 0.0)], clip_grad_norm=1.0))
sched = meshddp.LrScheduler(meshddp.LrScheduleConfig(max_lr=1e-2, warmup_steps=2, decay_steps=8,
                                                     decay_style="cosine"))
sched.attach(opt)
for step in range(steps):
    x, y = batch(step)
    ddp.zero_grad_buffer()
    loss = loss_fn(ddp(x), y)
    loss.backward()                       # buckets reduce-scatter while backward runs
    result = opt.step()                   # finishes the sync, clips, steps this rank's shard, all-gathers
    if not result.skipped:                # a non-finite gradient skips the step on every rank
        sched.step()
    losses.append(loss.item())
opt.save_checkpoint("ckpt", keep_last=2)  # ckpt/step-8/, any DP x TP can load it
opt.finish_param_sync()                   # before reading params outside forward

saved = [p.detach().clone() for p in ddp.parameters()]
assert losses[-1] < losses[0], losses
assert result.grad_norm > 0, result

# A fresh run resumes (the model as built above, then):
ddp = meshddp.DistributedDataParallel(MyModel(), mesh, dp_dim="dp",
                                      config=meshddp.DdpConfig(use_distributed_optimizer=True))
opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(
    lr=1e-2, weight_decay=0.01, groups=[("*.bias", None, 0.0)], clip_grad_norm=1.0))
opt.load_checkpoint("ckpt")               # the latest complete checkpoint; params all-gathered
opt.finish_param_sync()
for a, b in zip(saved, ddp.parameters()):
    assert torch.equal(a, b.detach()), "a param differs from the saved one after load_checkpoint"
assert opt.steps_taken == steps, opt.steps_taken
print(f"zero1 snippet: rank {dist.get_rank()} ok, losses {losses[0]:.4f} -> {losses[-1]:.4f}")
dist.destroy_process_group()
sys.stdout.flush(), sys.stderr.flush()
os._exit(0)  # not a finalizing interpreter under live Gloo threads (docs/guide/python.md, "Exiting")
