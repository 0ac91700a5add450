# docs/guide/pipelines.md, "From Python: torch.distributed.pipelining": a torch model split into 2 pipeline
# stages, each a meshddp DistributedDataParallel over "dp", driven by torch's Schedule1F1B.
# torchrun --standalone --nproc-per-node=4 tests/docs/snippets/torch_pipelining.py   (dp 2 x pp 2, CPU)
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import Schedule1F1B

import meshddp
import meshddp.pipelining

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()

torch.manual_seed(0)  # the same whole model on every rank; each keeps its stage's layers
layers = [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(4)]
stage_module = torch.nn.Sequential(*layers[2 * pp_rank:2 * pp_rank + 2])

ddp = meshddp.DistributedDataParallel(stage_module, mesh, dp_dim="dp")
stage = meshddp.pipelining.PipelineStage(ddp, pp_rank, 2, torch.device("cpu"), group=mesh["pp"].get_group())
schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=F.mse_loss)  # scale_grads=True: a mean loss
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)

for step in range(3):
    g = torch.Generator().manual_seed(100 * step + dp_rank)  # each DP rank its own batch
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    ddp.zero_grad_buffer()
    losses = []
    if stage.is_first:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    meshddp.pipelining.finalize_model_grads(stage)  # every chunk's sync done before the step
    optimizer.step()
    if losses:
        print(f"step {step} dp {dp_rank}: loss {torch.stack(losses).mean().item():.4f}")

print(f"rank {dist.get_rank()} ok")
dist.destroy_process_group()
