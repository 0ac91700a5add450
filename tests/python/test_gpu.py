"""The Python package on a GPU (scripts/gpu_check.sh runs this; without CUDA every test skips, and with
MESHDDP_REQUIRE_GPU=1 fails instead). One rank in this process: a CUDA model wrapped in
meshddp.DistributedDataParallel over torch's NCCL DeviceMesh, every bucket collective forced at world
size 1 (MESHDDP_FORCE_COLLECTIVES=1, read by the C++ engine once, at its first collective, so it is
set before anything runs), against the same model trained by torch alone on the same GPU:
  - plain DDP, gradients from nn.Linear and from meshddp.linear_with_grad_in_buffer, SGD + momentum;
  - ZeRO-1 (meshddp.DistributedOptimizer, AdamW: the fused CUDA kernel) against torch.optim.AdamW, and the
    same under data_parallel_sharding_strategy 'optim_grads' and 'optim_grads_params';
  - DDP over two DP dims ("dp", "cp") of a dp 1 x cp 1 x tp 1 NCCL mesh, in a spawned rank;
  - ZeRO-3 with torch TP (DTensor params) at DP 2 x TP 2, four spawned ranks on the GPU over Gloo.
Tolerance 1e-5 on the params after 10 steps: fp32 without TF32; the golden's AdamW is ATen's CUDA
foreach path, ours the fused kernel (a few ulps per step apart, tests/optimizer/fused_step_test.cpp)."""

import copy
import os
import socket

os.environ["MESHDDP_FORCE_COLLECTIVES"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import meshddp  # noqa: E402

STEPS = 10

if os.environ.get("MESHDDP_REQUIRE_GPU") == "1":
    assert torch.cuda.is_available(), "MESHDDP_REQUIRE_GPU=1 but torch sees no CUDA device"
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: scripts/gpu_check.sh runs this on a GPU")


class Net(torch.nn.Module):
    def __init__(self, grads_in_buffer=False):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(64, 64) for _ in range(3)])
        self.grads_in_buffer = grads_in_buffer

    def forward(self, x):
        for layer in self.layers:
            if self.grads_in_buffer:
                x = torch.tanh(meshddp.linear_with_grad_in_buffer(x, layer.weight, layer.bias))
            else:
                x = torch.tanh(layer(x))
        return x


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(32, 64, generator=g).cuda(), torch.randn(32, 64, generator=g).cuda()


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


@pytest.fixture(scope="module")
def mesh():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield init_device_mesh("cuda", (1,), mesh_dim_names=("dp",))
    dist.destroy_process_group()


@pytest.mark.parametrize("grads_in_buffer", [False, True])
def test_ddp_with_nccl_matches_torch_alone(mesh, grads_in_buffer):
    torch.manual_seed(0)
    golden = Net().cuda()
    model = copy.deepcopy(golden)
    model.grads_in_buffer = grads_in_buffer
    ddp = meshddp.DistributedDataParallel(model, mesh, "dp", meshddp.DdpConfig(bucket_bytes=4096))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    opt_golden = torch.optim.SGD(golden.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step)
        ddp.zero_grad_buffer()
        F.mse_loss(ddp(x), y).backward()
        ddp.finish_grad_sync()
        opt.step()
        opt_golden.zero_grad()
        F.mse_loss(golden(x), y).backward()
        opt_golden.step()
    torch.cuda.synchronize()
    assert model.layers[0].weight.is_cuda
    assert max_diff(model, golden) <= 1e-5


@pytest.mark.parametrize("strategy", ["optim", "optim_grads", "optim_grads_params"])
def test_zero1_with_fused_adamw_on_cuda_matches_torch_adamw(mesh, strategy):
    """ZeRO-1, and ZeRO-2 / ZeRO-3 (each unit's CUDA storage released and gathered again every step)."""
    torch.manual_seed(0)
    golden = Net().cuda()
    model = copy.deepcopy(golden)
    ddp = meshddp.DistributedDataParallel(model, mesh, "dp", meshddp.DdpConfig(
        bucket_bytes=4096, data_parallel_sharding_strategy=strategy))
    opt = meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig(kind="adamw", lr=0.01, weight_decay=0.01))
    opt_golden = torch.optim.AdamW(golden.parameters(), lr=0.01, weight_decay=0.01)
    for step in range(STEPS):
        x, y = batch(step)
        ddp.zero_grad_buffer()
        F.mse_loss(ddp(x), y).backward()
        assert not opt.step().skipped
        opt_golden.zero_grad()
        F.mse_loss(golden(x), y).backward()
        opt_golden.step()
    opt.finish_param_sync()
    torch.cuda.synchronize()
    whole = ddp.state_dict()  # under optim_grads_params a collective returning whole copies
    diff = max((whole[name] - p).abs().max().item() for name, p in golden.named_parameters())
    assert diff <= 1e-5, f"{strategy}: the params differ from torch AdamW's by {diff}"


def test_backward_with_check_for_nan_in_grad_makes_no_host_sync(mesh):
    """check_for_nan_in_grad counts each bucket's non-finite values on the device (CUB) before its
    collective and reads one total on the host, in finish_grad_sync(): backward itself must not sync.
    torch's sync debug mode makes every synchronizing call through c10 (.item(), a device-to-host copy,
    a stream synchronize) an error while backward runs; the bucket collectives are forced at world
    size 1, so each bucket's count and launch happen inside it."""
    torch.manual_seed(0)
    model = Net().cuda()
    ddp = meshddp.DistributedDataParallel(model, mesh, "dp",
                                          meshddp.DdpConfig(bucket_bytes=4096, check_for_nan_in_grad=True))
    assert ddp._engine.num_buckets() > 1
    for step in range(3):
        x, y = batch(step)
        ddp.zero_grad_buffer()
        loss = F.mse_loss(ddp(x), y)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert ddp._engine.buckets_launched_by_hooks() == ddp._engine.num_buckets()
        ddp.finish_grad_sync()


def test_two_ranks_on_cuda_tensors_over_gloo_match_torch():
    """Two spawned ranks on the one GPU (Gloo with CUDA tensors, as on a multi-GPU machine without
    NCCL peers): plain DDP and the in-buffer linear against torch's DDP on the same GPU, and ZeRO-1
    (the fused CUDA AdamW) against one-process torch.optim.AdamW, with a checkpoint round trip.
    Tolerances: at 2 ranks both DDPs reduce the same two values (order-free), on the same GEMMs: 1e-6
    allows for kernels torch may pick differently for a deep copy; ZeRO-1 as in the NCCL test above."""
    import tempfile

    import multiprocess

    with tempfile.TemporaryDirectory() as tmp:
        results = multiprocess.run(2, "cuda_suite", checkpoint_dir=os.path.join(tmp, "ckpt"))
    for rank, r in enumerate(results):
        for case in (("plain", "sgd"), ("in_buffer", "adamw")):
            assert r[case]["grad_diff"] <= 1e-6, f"rank {rank} {case}: gradients differ by {r[case]['grad_diff']}"
            assert r[case]["param_diff"] <= 1e-6, f"rank {rank} {case}: params differ by {r[case]['param_diff']}"
        assert r["zero1"]["param_diff"] <= 1e-5, f"rank {rank}: ZeRO-1 differs by {r['zero1']['param_diff']}"
        assert r["zero1"]["skipped"] == [False] * 10
        assert r["zero1"]["reloaded_diff"] == 0.0


def test_zero3_with_torch_tp_on_cuda_tensors_over_gloo_matches_one_process_and_zero1():
    """Four spawned ranks on the one GPU, DP 2 x TP 2 (parallelize_module: DTensor params) under
    'optim_grads_params': the DTensors' local shards sharded over DP, released between uses (CUDA storages
    freed and re-grown), gathered when a DTensor op reads them (the mode sees through the DTensor). Against
    one process (1e-5, as ZeRO-1 above) and the 'optim' run on the same GPU (bit for bit: the same reductions
    of two values and the same kernels); only the shards held after the step."""
    import multiprocess

    zero3 = multiprocess.run(4, "tp_vs_single", dp=2, tp=2, optimizer="zero3", device="cuda")
    zero1 = multiprocess.run(4, "tp_vs_single", dp=2, tp=2, optimizer="zero1", device="cuda")
    for rank, (a, b) in enumerate(zip(zero3, zero1)):
        assert a["param_diff"] <= 1e-5, f"rank {rank}: ZeRO-3 with TP differs from one process by {a['param_diff']}"
        for i, (x, y) in enumerate(zip(a["params"], b["params"])):
            assert x.equal(y), f"rank {rank}: param {i} differs between optim_grads_params and optim"
        held, shards, _ = a["param_bytes"]
        assert held == shards, f"rank {rank}: {held} bytes of param storage after the step, its shards {shards}"
        assert a["reloaded_equal"], f"rank {rank}: load_state_dict(state_dict()) changed the params on CUDA"


def test_dp_x_cp_groups_on_nccl_match_one_process():
    """A spawned rank on a dp 1 x cp 1 x tp 1 NCCL mesh (multi_dim_workers.py): DDP over ("dp", "cp") with
    the collectives forced on the flattened group. At one rank the gradient is the one-process gradient
    bit for bit (a sum over one rank, divided by 1), so plain SGD is exact; ZeRO-1's fused AdamW as above."""
    import multiprocess

    r = multiprocess.run(1, "multi_dim_workers.multi_dim_on_one_gpu", _backend="nccl")[0]
    assert r["sgd"]["grad_diff"] == 0.0 and r["sgd"]["param_diff"] == 0.0, r["sgd"]
    assert r["zero1"]["param_diff"] <= 1e-5, r["zero1"]
    assert r["sgd"]["dp_ranks"] == [0] and r["sgd"]["tp_dim"] == "tp", r["sgd"]
