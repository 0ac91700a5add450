"""Per-rank bodies of test_porting_misuse.py's multi-rank cases."""

import torch

import meshddp
from torch.distributed.device_mesh import init_device_mesh


def grad_scaler_with_zero1(rank, world_size):
    """torch.amp.GradScaler over meshddp's DistributedOptimizer at 2 ranks, with a real reduce-scatter
    (comm_hook="bf16_compress"; Gloo's plain one is a whole-bucket all-reduce): step 0 has an inf in rank 1's
    local gradient of '0.weight' only, step 1 is clean. Returns (scale after each step, params after each
    step, the golden's params: torch SGD with its own GradScaler on the mean gradient)."""
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    golden = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    golden.load_state_dict(model.state_dict())
    config = meshddp.DdpConfig(use_distributed_optimizer=True, comm_hook="bf16_compress")
    ddp = meshddp.DistributedDataParallel(model, mesh, config=config)
    opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="sgd", lr=0.1))
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scales, params = [], []
    for step in range(2):
        ddp.zero_grad_buffer()
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        with ddp.no_sync():  # hold the buckets so that the inf goes in before the reduction
            scaler.scale(ddp(x).sum()).backward()
        if step == 0 and rank == 1:
            with torch.no_grad():
                model[0].weight.main_grad.view(-1)[-1] = float("inf")
        scaler.step(opt)  # before: rank 1 found the inf and skipped, rank 0 stepped: a hang
        scaler.update()
        opt.finish_param_sync()
        scales.append(scaler.get_scale())
        params.append([p.detach().clone() for p in model.parameters()])
    # Golden for the clean step 1 (step 0 skipped): SGD on the mean of the ranks' gradients.
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(10 + r)) for r in range(world_size)]
    sum(golden(x).sum() for x in xs).div(world_size).backward()
    torch.optim.SGD(golden.parameters(), lr=0.1).step()
    return scales, params, [p.detach().clone() for p in golden.parameters()]
