"""Per-rank bodies of test_compile_parallel.py, backend="aot_eager" throughout:
- pipelines: pipelining_workers.py's 4-layer MLP on dp 2 x pp 2 (4 ranks), each stage's chunk a
  meshddp.DistributedDataParallel in a meshddp.pipelining.PipelineStage, trained eagerly and with compiled
  stage modules, against one process on the global batch;
- experts: surface_workers.py's dense MoE on an ("edp", "ep") 2 x 2 mesh (torchtitan-style DTensor experts
  and HF-style expert modules), the wrapper compiled, against eager and one process;
- compiled autograd turned on around backward only (after wrapping and forward), both ways.
"""

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import meshddp
import meshddp.pipelining
import pipelining_workers as pw
import surface_workers as sw

BACKEND = "aot_eager"


def compile_stages(wrapped, how):
    """Compiles this rank's stage modules in place: "wrapper" (ddp.compile(): the wrapper compiled, its
    module's graph split at the buckets; the DDP stays the stage's submodule) or "per_block" (each block of
    the stage compiled after wrapping, torchtitan's way)."""
    for _, ddp in wrapped:
        if how == "wrapper":
            ddp.compile(backend=BACKEND)
        elif how == "per_block":
            for block in ddp.module:
                block.compile(backend=BACKEND)
        elif how != "eager":
            raise ValueError(how)


def _golden_diffs(wrapped, grads, params, schedule, dp_size, pp_size):
    """(max |grad - golden|, max |param - golden|) over this rank's params, as pipelining_workers.pipelined."""
    ref, ref_grads = pw.golden(dp_size)
    per_stage = pw.LAYERS // (pp_size * pw.SCHEDULES[schedule][1])
    grad_diff = param_diff = 0.0
    i = 0
    for index, _ in wrapped:
        for block_index in range(index * per_stage, (index + 1) * per_stage):
            for name in ("weight", "bias"):
                p_ref = getattr(ref[block_index].fc, name)
                g_ref = ref_grads[2 * block_index + (name == "bias")]
                grad_diff = max(grad_diff, (grads[i] - g_ref).abs().max().item())
                param_diff = max(param_diff, (params[i] - p_ref.detach()).abs().max().item())
                i += 1
    return grad_diff, param_diff


def compiled_pipelines(rank, world_size, schedules, modes=("wrapper", "per_block")):
    """Per (schedule, mode): {"golden": (grad diff, param diff) against one process, "eager": max |param -
    the same pipeline run eagerly| (0.0 = bit-identical), "graphs": Dynamo's unique graph count after the
    first and the last of pipelining_workers.STEPS steps}."""
    dp_size, pp_size = 2, 2
    mesh = init_device_mesh("cpu", (dp_size, pp_size), mesh_dim_names=("dp", "pp"))
    out = {}
    for schedule in schedules:
        _, eager_params = pw.train(mesh, *pw.build(mesh, schedule), schedule)
        for mode in modes:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            stages, wrapped = pw.build(mesh, schedule)
            compile_stages(wrapped, mode)
            graphs = []
            original_step = meshddp.pipelining.finalize_model_grads

            def counting_finalize(chunks, *args, **kwargs):
                result = original_step(chunks, *args, **kwargs)
                graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
                return result

            meshddp.pipelining.finalize_model_grads = counting_finalize
            try:
                grads, params = pw.train(mesh, stages, wrapped, schedule)
            finally:
                meshddp.pipelining.finalize_model_grads = original_step
            out[(schedule, mode)] = {
                "golden": _golden_diffs(wrapped, grads, params, schedule, dp_size, pp_size),
                "eager": max((a - b).abs().max().item() for a, b in zip(params, eager_params)),
                "graphs": (graphs[0], graphs[-1]),
            }
    return out


def stage_of_torch_compiled_wrapper(rank, world_size):
    """The error of a PipelineStage given torch.compile(ddp) (not ddp.compile())."""
    ddp = meshddp.DistributedDataParallel(pw.full_model(), process_group=torch.distributed.group.WORLD)
    try:
        meshddp.pipelining.PipelineStage(torch.compile(ddp, backend=BACKEND), 0, 1, torch.device("cpu"))
    except RuntimeError as e:
        return str(e)
    return None


# -- experts --------------------------------------------------------------------------------------
class _EagerAutogradCollectives:
    """torch.distributed.nn.functional for surface_workers.Moe's EP exchange (autograd all-reduces), run
    eagerly: Dynamo's trace of that all_reduce gives other gradients than eager (measured up to 0.1 on the
    model alone, compiled without meshddp, torch 2.11), so the exchange is a graph break here, as a real
    MoE's all-to-all outside the compiled experts."""

    all_reduce = staticmethod(torch.compiler.disable(sw.dist_fn.all_reduce))


def _train_moe(mesh, hf_style, compiled, steps):
    """This rank's params (local shards) after `steps` SGD steps of surface_workers.Moe wrapped over both
    dims (expert params reduced over expert-DP), and Dynamo's unique graph count after each step."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    sw.dist_fn = _EagerAutogradCollectives
    model = sw.Moe(ep_mesh=mesh["ep"], hf_style=hf_style)
    config = meshddp.DdpConfig(expert_parallel_size=mesh["ep"].size(), bucket_bytes=512)
    ddp = meshddp.DistributedDataParallel(model, mesh, dp_dim=("edp", "ep"), config=config,
                                          expert_params=["experts.*"] if hf_style else ())
    run = torch.compile(ddp, backend=BACKEND) if compiled else ddp
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    graphs = []
    for step in range(steps):
        x, y = sw.data(step, sw.ROWS * world)
        ddp.zero_grad_buffer()
        F.mse_loss(run(x[rank * sw.ROWS:(rank + 1) * sw.ROWS]), y[rank * sw.ROWS:(rank + 1) * sw.ROWS]).backward()
        ddp.finish_grad_sync()
        opt.step()
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    params = {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for n, p in ddp.named_parameters()}
    return params, graphs, {n for n, p in ddp.named_parameters() if isinstance(p, DTensor)}


def _golden_moe(steps, world):
    """The one-process MoE (every expert local) after `steps` SGD steps on the global batches."""
    golden = sw.Moe()
    opt = torch.optim.SGD(golden.parameters(), lr=0.1)
    for step in range(steps):
        x, y = sw.data(step, sw.ROWS * world)
        opt.zero_grad()
        F.mse_loss(golden(x), y).backward()
        opt.step()
    return dict(golden.named_parameters())


def compiled_experts(rank, world_size, steps=3):
    """Per style ("dtensor": torchtitan's experts as DTensors Shard(0) over "ep"; "hf": one module per
    expert): max |compiled - eager| and max |compiled - one process| over this rank's params, and the
    graph counts per step of the compiled run."""
    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("edp", "ep"))
    golden = _golden_moe(steps, world_size)
    e = mesh.get_local_rank("ep")
    out = {}
    for style in ("dtensor", "hf"):
        eager, _, _ = _train_moe(mesh, style == "hf", False, steps)
        compiled, graphs, dtensors = _train_moe(mesh, style == "hf", True, steps)

        def reference(name):  # surface_workers.local_golden: an expert DTensor's EP chunk, an HF expert's row
            if name in dtensors:
                return golden[name].detach().chunk(2)[e]
            return sw.local_golden(name, None, golden, 2, e)

        out[style] = {
            "eager": max((compiled[n] - eager[n]).abs().max().item() for n in compiled),
            "golden": max((compiled[n] - reference(n)).abs().max().item() for n in compiled),
            "graphs": graphs,
        }
    return out
