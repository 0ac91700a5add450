"""docs/reference/checkpoints.md's torch.distributed.checkpoint block, run under torchrun
(tests/docs/test_doc_snippets.py) in a scratch directory given as argv[1]: meshddp's ZeRO-1 trains,
saves with DCP, trains on, then a freshly built ddp and opt load the save as the block does and must
hold the saved params exactly."""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import meshddp


def build():
    torch.manual_seed(int(os.environ["RANK"]) + 10)  # different on each rank: DDP broadcasts rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ddp = meshddp.DistributedDataParallel(model, mesh, config=meshddp.DdpConfig(use_distributed_optimizer=True))
    return ddp, meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(lr=1e-2))


def train(ddp, opt, steps):
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        ddp.zero_grad_buffer()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    opt.finish_param_sync()


os.chdir(sys.argv[1])
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
ddp, opt = build()
train(ddp, opt, 3)
saved = [p.detach().clone() for p in ddp.parameters()]
import torch.distributed.checkpoint as dcp

dcp.save({"model": ddp.state_dict(), "optim": opt.state_dict()}, checkpoint_id="ckpt/step-100")
train(ddp, opt, 2)
ddp, opt = build()
# later, at any DP size (the same TP size), in a freshly built ddp and opt:
sd = {"model": ddp.state_dict(), "optim": opt.state_dict()}   # holds every tensor already
dcp.load(sd, checkpoint_id="ckpt/step-100")                    # fills the model and optimizer in place
ddp.load_state_dict(sd["model"])
opt.load_state_dict(sd["optim"])                               # step count, LRs, masters -> params
opt.finish_param_sync()
for a, b in zip(saved, ddp.parameters()):
    assert torch.equal(a, b.detach()), "a param differs from the saved one after the DCP load"
print(f"dcp snippet: rank {dist.get_rank()} ok")
dist.destroy_process_group()
sys.stdout.flush(), sys.stderr.flush()
os._exit(0)  # not a finalizing interpreter under live Gloo threads (docs/guide/python.md, "Exiting")
