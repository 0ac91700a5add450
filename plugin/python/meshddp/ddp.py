"""meshddp.DistributedDataParallel: wraps a torch.nn.Module for data parallelism over one dim of a
torch DeviceMesh (or several, flattened: DP x CP), or a DP ProcessGroup. Everything per step runs
in C++ (meshddp._C): this file only turns the module, the mesh and DTensor params into named
tensors and c10d groups, once.

A step (as with Megatron's DDP):
    ddp.zero_grad_buffer()                  # not optimizer.zero_grad(): grads are views of the buffer
    for m in range(k):
        ddp.set_requires_gradient_sync(m == k - 1)  # or wrap micro-batches 0..k-2 in `with ddp.no_sync():`
        loss_fn(ddp(x[m]), y[m]).div(k).backward()  # buckets reduce over "dp" while backward runs
    ddp.finish_grad_sync()                  # param.grad now holds the DP mean
    optimizer.step()
"""

import contextlib
import datetime

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate, Shard
from torch.utils._pytree import tree_leaves

from meshddp import _C, _compiled_sections, _deprecated, _grad_shards, _groups, _guards, _sharded_params
from meshddp import compile as _compile


def _error(what):
    return RuntimeError(f"meshddp.DistributedDataParallel: {what}")


def _check_wrappable(module):
    """Refuses, naming them, what the flat buffers cannot take and torch would only fail on later: a
    lazy module's uninitialized params, and modules that produce sparse gradients."""
    for name, p in module.named_parameters():
        if isinstance(p, torch.nn.parameter.UninitializedParameter):
            raise _error(f"parameter '{name}' is uninitialized (a lazy module such as nn.LazyLinear before its "
                         f"first forward); run one forward (a dry run on a sample batch) before wrapping, as "
                         f"torch's DistributedDataParallel requires")
    for name, m in module.named_modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad:
            raise _error(f"module '{name}' is a {type(m).__name__} with sparse=True, whose gradient is sparse, but "
                         f"meshddp reduces gradients in a dense flat buffer; build it with sparse=False, or keep "
                         f"it out of DistributedDataParallel")


def _dp_dims_of(dp_dim):
    """dp_dim as a tuple of dim names: one name ("dp") or several ("dp", "cp")."""
    dims = (dp_dim,) if isinstance(dp_dim, str) else dp_dim
    if not isinstance(dims, (tuple, list)) or not dims or not all(isinstance(d, str) for d in dims):
        raise _error(f"dp_dim must be a mesh dim name or a tuple of them (e.g. ('dp', 'cp')), got {dp_dim!r}")
    return tuple(dims)


def _flattened_dp_group(mesh, dp_dims):
    """The group gradients are averaged over: mesh[dp_dim]'s, or torch's flattened group of several
    dims (mesh["dp", "cp"]._flatten()), whose ranks must be those the C++ arithmetic gives
    (meshddp._C.flattened_group_ranks: the order DdpEngine uses on a C++ mesh), checked here."""
    names, sizes = list(mesh.mesh_dim_names), list(mesh.shape)
    mesh_ranks = _ranks_of(mesh)
    if dist.get_rank() not in mesh_ranks:
        raise _error(f"this rank ({dist.get_rank()}) is not in the mesh (ranks {mesh_ranks})")
    try:  # dims unknown, repeated or out of mesh order: the C++ text
        expected = _C.flattened_group_ranks(mesh_ranks.index(dist.get_rank()), sizes, names, list(dp_dims))
    except RuntimeError as e:
        raise _error(f"dp_dim {dp_dims}: {e}") from None
    if len(dp_dims) == 1:
        group = mesh.get_group(dp_dims[0])
    else:
        group = mesh[dp_dims]._flatten().get_group()
    expected = [mesh_ranks[i] for i in expected]
    got = dist.get_process_group_ranks(group)
    if got != expected:  # torch's flattening changed order: the DP ranks would not be C++'s
        raise AssertionError(f"meshddp: torch's group over {dp_dims} has ranks {got}, expected {expected}")
    return group


def _resolve_groups(mesh, dp_dims, process_group, tp_dim):
    """(dp group, world group or None, tp dim name or None, tp_rank, tp_size, tp group or None: None
    when the TP dim has one rank). The DP group is the flattened group of `dp_dims` (one or more
    dims of the mesh)."""
    if process_group is not None:
        if mesh is not None:
            raise _error("give either a DeviceMesh (mesh=) or a DP process group (process_group=), not both")
        if not isinstance(process_group, dist.ProcessGroup):
            raise _error(f"process_group must be a torch.distributed.ProcessGroup, got {type(process_group).__name__}")
        return process_group, None, None, 0, 1, None
    if not isinstance(mesh, DeviceMesh):
        raise _error(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh (e.g. from init_device_mesh), got "
            f"{type(mesh).__name__}; for a plain DP group pass process_group= a torch.distributed.ProcessGroup")
    names = mesh.mesh_dim_names
    for dp_dim in dp_dims:
        if names is None or dp_dim not in names:
            raise _error(
                f"the mesh has no dim named '{dp_dim}' (dp_dim); its dims are {names} with shape "
                f"{tuple(mesh.shape)}; pass dp_dim= one of them (or a tuple of them, in mesh order), or name the "
                f"mesh's dims with init_device_mesh(..., mesh_dim_names=...)")
    # A "pp" dim is neither DP nor TP: each pipeline stage syncs within itself (docs/guide/pipelines.md).
    stage = [(n, size) for n, size in zip(names, mesh.shape) if n != "pp"]
    others = [n for n, _ in stage if n not in dp_dims]
    if tp_dim is None:
        # The C++ rule (meshddp::tp_dim_of), so both languages pick the same dim: the one dim besides DP
        # with more than one rank. With none, a single other dim (of size 1) is kept, so that DTensors
        # parallelized over it are accepted (a TP size of 1 is no TP to the engine).
        try:
            tp_dim = _C.tp_dim_of([n for n, _ in stage], [size for _, size in stage], list(dp_dims)) or None
        except RuntimeError as e:
            raise RuntimeError(f"meshddp.{e}; or name the tensor-parallel dim with tp_dim=") from None
        if tp_dim is None and len(others) == 1 and others == [n for n in names if n not in dp_dims]:
            tp_dim = others[0]
    elif tp_dim not in others:
        raise _error(f"tp_dim '{tp_dim}' is not a dim of the mesh other than dp_dim {dp_dims}: the dims are {names}")
    dp_group = _flattened_dp_group(mesh, dp_dims)
    if tp_dim is None:
        return dp_group, None, None, 0, 1, None
    tp_size = mesh.size(names.index(tp_dim))
    tp_rank = mesh.get_local_rank(tp_dim)
    if mesh.size() == dist.get_world_size() and "pp" not in names:
        world = dist.distributed_c10d._get_default_group()
    else:
        world = mesh[tuple(n for n in names if n in dp_dims or n == tp_dim)]._flatten().get_group()
    return dp_group, world, tp_dim, tp_rank, tp_size, mesh.get_group(tp_dim) if tp_size > 1 else None


def _ranks_of(mesh):
    return mesh.mesh.flatten().tolist()


def _tp_shard_dim(name, param, ddp_mesh, tp_dim):
    """The tensor dim a DTensor param is sharded on over TP (-1: Replicate). Its mesh must be the TP
    sub-mesh of the DDP mesh (the same ranks in the same order: mesh[tp_dim]), or the DDP mesh itself
    with Replicate over DP; anything else (a model parallelized over mesh["dp"], or over any other
    mesh of the TP size) would have its shards broadcast over each other and averaged."""
    pmesh = param.device_mesh
    pnames = pmesh.mesh_dim_names or ()
    on_tp_mesh = tp_dim is not None and pmesh.ndim == 1 and _ranks_of(pmesh) == _ranks_of(ddp_mesh[tp_dim])
    on_ddp_mesh = (tp_dim is not None and pmesh.ndim == ddp_mesh.ndim and pnames == ddp_mesh.mesh_dim_names
                   and pmesh.mesh.tolist() == ddp_mesh.mesh.tolist())
    if not (on_tp_mesh or on_ddp_mesh):
        expected = (f"the TP sub-mesh mesh['{tp_dim}'] (ranks {_ranks_of(ddp_mesh[tp_dim])} on this rank)"
                    if tp_dim is not None else "a TP dim, but the DDP mesh has none")
        raise _error(
            f"parameter '{name}' is a DTensor on a mesh with dims {pnames} and ranks {pmesh.mesh.tolist()}, but "
            f"meshddp expects {expected}: its shards would be averaged over the wrong ranks. Parallelize the "
            f"module over the TP dim of the mesh given to DistributedDataParallel (parallelize_module(module, "
            f"mesh['tp'], plan)), or keep it out of DDP")
    shard_dim = -1
    for i, placement in enumerate(param.placements):
        on_tp = on_tp_mesh or pnames[i] == tp_dim
        if isinstance(placement, Shard) and on_tp:
            shard_dim = placement.dim
        elif not isinstance(placement, (Shard, Replicate)) or (isinstance(placement, Shard) and not on_tp):
            raise _error(f"parameter '{name}' has placements {param.placements} on mesh dims {pnames}: meshddp "
                         f"supports DTensor params that are Shard or Replicate over TP and replicated over DP")
    return shard_dim


def _register_progress(groups, stuck_report_after, timeout):
    """Progress records (mesh/collective_progress.h) for meshddp's groups, so waits on them report
    stuck peers as on a C++ mesh. Each group's record lives under its own prefix of the default store
    (group names agree across ranks)."""
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if timeout is None:
        timeout = dist.distributed_c10d._get_default_timeout(dist.get_backend()).total_seconds()
    store = dist.distributed_c10d._get_default_store()
    seen = set()
    for group in groups:
        if group is None or group.group_name in seen:
            continue
        seen.add(group.group_name)
        _C._register_collective_progress(group, dist.PrefixStore(f"meshddp/progress/{group.group_name}", store),
                                         dist.get_process_group_ranks(group), float(stuck_report_after),
                                         float(timeout))


def _sharding_applied(config):
    """The config with data_parallel_sharding_strategy applied (docs/guide/sharding.md): 'optim',
    'optim_grads' and 'optim_grads_params' are use_distributed_optimizer (a copy with it set; the caller's
    config is left alone);
    'no_shard' with use_distributed_optimizer is refused. Called after the ranks agreed on the config, so
    every rank decides alike."""
    strategy = config.data_parallel_sharding_strategy
    if strategy == "no_shard" and config.use_distributed_optimizer:
        raise _error("data_parallel_sharding_strategy='no_shard' contradicts use_distributed_optimizer=True (the "
                     "'optim' strategy); set one of them")
    if strategy in ("optim", "optim_grads", "optim_grads_params") and not config.use_distributed_optimizer:
        config = _C.DdpConfig(**{name: getattr(config, name) for name in config.field_names()})
        config.use_distributed_optimizer = True
    return config


class DistributedDataParallel(torch.nn.Module):
    """Data parallelism for `module` over the `dp_dim` dim of `mesh` (a torch DeviceMesh), or over
    `process_group`. `dp_dim` may name several dims, in mesh order (e.g. ("dp", "cp") for context
    parallel): every gradient is then averaged over their flattened group (torch's
    mesh["dp", "cp"]._flatten(), 1/(dp*cp)), as the C++ DistributedDataParallel(model, mesh,
    {"dp", "cp"}); the one remaining dim with more than one rank is TP. Construction is a
    collective over DP: it checks that every DP rank holds the same parameters and broadcasts DP
    rank 0's parameters and buffers (DdpConfig fields verify_model_across_ranks,
    broadcast_from_rank0). DTensor params (torch TP via parallelize_module over the mesh's TP dim)
    are synced by their local shards; DTensor does TP."""

    def __init__(self, module, mesh=None, dp_dim="dp", config=None, *, process_group=None, tp_dim=None,
                 stuck_report_after=30.0, timeout=None, embedding_group=None, expert_params=()):
        """stuck_report_after (seconds; 0 = off): as a C++ mesh's MeshOptions.stuck_report_after, a rank
        that waits this long for one of meshddp's collectives (a bucket reduction, a param all-gather, a
        start-up check) prints to stderr, then each time the wait doubles, a line naming the group, the
        collective and the ranks that have not launched it yet (e.g. one rank ran one more step). The
        DP, TP and world groups get a progress record for it, kept in the default store.
        timeout (a datetime.timedelta or seconds; default: torch's default for the backend): the
        MeshOptions.timeout of these records, after which a wait that polls (NCCL with
        MESHDDP_NCCL_BLOCKING_WAIT=1) fails naming the collective; a Gloo group fails after the timeout
        it was created with (init_process_group(timeout=)).
        embedding_group (a ProcessGroup; pipeline parallel): the first and last stage of this rank's
        pipeline (meshddp.groups.embedding_groups gives them), over which the two copies of a weight tied across
        stages (meshddp.declare_tied_across_stages) are summed before the DP reduction. Default: made from
        `mesh` when it has a "pp" dim (by the group's members, at the first DDP over the mesh). A "pp" dim
        of `mesh` is neither DP nor TP: each stage syncs within itself (docs/guide/pipelines.md).
        expert_params: module-path patterns ('*' any run of characters, e.g. "*.experts.*") of expert
        (MoE) params, reduced over the expert-data-parallel group (DdpConfig.expert_parallel_size);
        DTensor params on the expert-parallel sub-mesh are expert params without a pattern
        (meshddp/_groups.py)."""
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise _error(f"module must be a torch.nn.Module, got {type(module).__name__}")
        config = _C.DdpConfig() if config is None else config
        if not isinstance(config, _C.DdpConfig):
            raise _error(f"config must be a meshddp.DdpConfig, got {type(config).__name__}")
        dp_dims = _dp_dims_of(dp_dim)
        dp_group, world, tp_dim, tp_rank, tp_size, tp_group = _resolve_groups(mesh, dp_dims, process_group, tp_dim)
        # Every field agreed over the mesh, then validated (Note [Agree first, then validate],
        # mesh/config_fields.h), before any field is used: a value invalid on one rank only fails every
        # rank here alike, naming the field and each rank's value.
        _C._verify_same_settings(world or dp_group, config._settings(), "DistributedDataParallel",
                                 "the DdpConfig settings")
        config.validate()
        config = _sharding_applied(config)
        ep = config.expert_parallel_size
        instance_group, cross_group = _groups.optimizer_instance_groups(mesh, dp_dims, config, world or dp_group)
        if instance_group is not None and world is None:
            # The engine's DP group becomes the instance; the gradient norm, the non-finite check and
            # checkpoints still span every DP rank (world), as with a mesh that has a TP dim. Without it
            # a 1-D mesh summed the norm within each instance: one instance clipped, the other did not.
            world = dp_group
        if embedding_group is None:
            embedding_group = _groups.embedding_group(mesh)  # a "pp" dim: made from the mesh
        expert_dp_group = _groups.expert_dp_group(mesh, dp_dims, ep) if ep > 1 else None
        expert_instance_group = _groups.expert_instance_group(mesh, dp_dims, config)
        pipeline_group = _groups.pipeline_group(mesh)  # a "pp" dim: norms and non-finite checks span the stages
        self._pipeline_group = pipeline_group  # meshddp.pipelining.PipelineStage checks it is its own
        _register_progress([dp_group, world, tp_group, instance_group, cross_group, expert_dp_group,
                            expert_instance_group],
                           stuck_report_after, timeout)
        self.module = module
        self.mesh = mesh
        self.dp_dim = dp_dim
        self.dp_dims = dp_dims  # dp_dim as a tuple: ("dp",) or e.g. ("dp", "cp")
        self.tp_dim = tp_dim
        # For DistributedOptimizer.state_dict() / load_state_dict() (meshddp/_state_dict.py).
        self._dp_group, self._world_group, self._tp_rank, self._tp_size = dp_group, world or dp_group, tp_rank, tp_size

        _check_wrappable(module)
        _guards.refuse_torch_ddp_inside(module)
        params, dtensors = [], []
        self._engine_names = {}  # module path -> the engine's name, where they differ (EP DTensor shards)
        for name, p in module.named_parameters():  # deduplicated: a tied tensor keeps its first name
            if isinstance(p, DTensor) and _groups.is_expert_dtensor(p, mesh, dp_dims, ep):
                local = p._local_tensor
                _C._declare_expert_param(local)
                self._engine_names[name] = _groups.expert_name(name, p, mesh, dp_dims, ep)
                if p.requires_grad:
                    local.requires_grad_(True)
                    dtensors.append((self._engine_names[name], p, local, -1))  # replicated over TP
                params.append((self._engine_names[name], local))
            elif isinstance(p, DTensor):
                local = p._local_tensor
                if p.requires_grad:
                    if config.grad_reduce_in_fp32 and p.dtype in (torch.bfloat16, torch.float16):
                        raise _error(f"parameter '{name}' is a {p.dtype} DTensor: grad_reduce_in_fp32 is not "
                                     f"supported for DTensor params (their .grad must be a view of the buffer)")
                    local.requires_grad_(True)  # trainable for the GradBuffer (Note [DTensor parameters])
                    if mesh is None:
                        raise _error(f"parameter '{name}' is a DTensor: give the DeviceMesh (mesh=) it was "
                                     f"parallelized over, not a process group")
                    dtensors.append((name, p, local, _tp_shard_dim(name, p, mesh, tp_dim)))
                params.append((name, local))
            else:
                if expert_params and _groups.matches(name, expert_params):
                    _C._declare_expert_param(p)
                params.append((name, p))
        buffers = [(n, b._local_tensor if isinstance(b, DTensor) else b) for n, b in module.named_buffers()]
        self._engine = _C._Ddp(params, buffers, dtensors, dp_group, world, tp_group, tp_rank, tp_size,
                               dist.get_process_group_ranks(dp_group), config, embedding_group=embedding_group,
                               expert_dp_group=expert_dp_group, instance_group=instance_group,
                               cross_instance_group=cross_group, expert_instance_group=expert_instance_group,
                               pipeline_group=pipeline_group)
        # optim_grads (and optim_grads_params): no whole gradient buffer (grads are sharded after each bucket's
        # reduce-scatter): param.main_grad is refused by name (meshddp/_grad_shards.py), param.grad is None after
        # backward. optim_grads_params: the params are shards too, gathered per unit on use (_sharded_params.py).
        self._strategy = config.data_parallel_sharding_strategy or ("optim" if config.use_distributed_optimizer else "no_shard")
        self._shards_grads = self._strategy in ("optim_grads", "optim_grads_params")
        self._shards_params = self._strategy == "optim_grads_params"
        self._wrap_section = _compiled_sections.section_wrapper(self) if self._shards_params else None
        if self._shards_params:
            self._engine.intercept_param_reads_in_this_thread()
            _sharded_params.refuse_released_in_state_dict(module)
        grads = {}
        self._dtensor_grad_hooks = []
        for name, p, local, _ in dtensors:
            if self._shards_grads:  # each new DTensor gradient handed to the engine by its local shard
                self._dtensor_grad_hooks.append(_grad_shards.hand_dtensor_grad_to(p, local, self))
            else:
                grads[name] = DTensor.from_local(self._engine.main_grad(name), p.device_mesh, p.placements,
                                                 run_check=False, shape=p.shape, stride=p.stride())
        if not self._shards_grads:
            self._engine.set_dtensor_grads(list(grads.values()))
        # param.main_grad, as Megatron and veScale read it: the param's slot in the flat buffer (fp32 with
        # grad_reduce_in_fp32); for a DTensor param the DTensor over its slot (its .grad).
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            engine_name = self._engine_names.get(name, name)
            if self._shards_grads:
                _grad_shards.refuse_main_grad(p, name, self._strategy)
            else:
                _grad_shards.allow_main_grad(p)  # wrapped under optim_grads before: main_grad settable again
                p.main_grad = grads[engine_name] if isinstance(p, DTensor) else self._engine.main_grad(engine_name)
        # ZeRO-1: one gradient of each flat buffer, whose version counter (shared by every view of the buffer)
        # tells DistributedOptimizer.step() whether the gradients were written after finish_grad_sync().
        # optim_grads: none (no gradient is reachable from outside: .grad is None, main_grad refused).
        probes = {}
        if config.use_distributed_optimizer and not self._shards_grads:
            for name in self._engine.param_names():
                g = self._engine.main_grad(name)
                probes.setdefault(g.untyped_storage().data_ptr(), g)
        self._version_probes = list(probes.values())
        self._synced_grad_version = None
        # What the buffers hold: "zeroed" (nothing since zero_grad_buffer(), or accumulating), "synced" (a
        # finished sync), "stepped" (an optimizer stepped on them; _guards.py, DistributedOptimizer.step):
        # meshddp.pipelining accumulates across steps on "synced" and refuses "stepped".
        self._grads_state = "zeroed"
        # meshddp.pipelining's accumulation across schedule.step() calls: the earlier steps' synced gradients
        # ((name, gradient) pairs) while a later step runs, added back by whatever finishes its sync; and the
        # stage's own start of the sync (scaled) when the schedule did not start it (a weakref.WeakMethod).
        self._set_aside = None
        self._before_finish = None
        self._find_unused = config.find_unused_parameters
        # meshddp/_guards.py: torch's DDP around this one leaves its params alone; a torch optimizer's step
        # before finish_grad_sync() is refused; with ZeRO-1, the raw module's forward waits for its params.
        self._ddp_params_and_buffers_to_ignore = _guards.names_for_torch_ddp(module)
        _guards.mark_wrapped_module(self, module)
        self._torch_ddp_checked = None
        _guards.remember_params(self, module)
        _guards.watch_optimizer_steps(self)
        if config.use_distributed_optimizer:
            _guards.guard_raw_forward(self, module)
        # Loaded as a submodule (torch.compile(ddp).load_state_dict: nn.Module's recursion, not load_state_dict
        # below): the keys are the module's own, as state_dict() writes them, and the engine's checks run.
        self._register_load_state_dict_pre_hook(self._load_as_submodule, with_module=False)
        self.register_load_state_dict_post_hook(lambda module, incompatible: module._engine.notify_params_changed())

    # -- a step -----------------------------------------------------------------------------------
    @torch.compiler.disable(recursive=False, reason=(
        "meshddp.DistributedDataParallel.forward runs eagerly (its checks and waits) and compiles the wrapped "
        "module's forward; with fullgraph=True compile the wrapper itself, torch.compile(ddp), not a function "
        "that calls it (docs/guide/compile.md)"))
    def forward(self, *args, **kwargs):
        """The module's forward, after checking the previous step's sync has finished (a RuntimeError
        naming the params otherwise). With the distributed optimizer's overlapped param gather, each
        op waits for the all-gather of its own params' bucket; when the module may run compiled code,
        every pending gather is waited for first (compiled kernels read params without those waits).
        Under torch.compile this method runs eagerly and the module's forward is compiled, split at the
        bucket boundaries (Note [Compiling through the wrapper], meshddp/compile.py)."""
        # Skipped by Dynamo, but not the Python functions it calls: the one call below is to a function
        # Dynamo skips as a whole, handed torch.compile's callback (a builtin's result, no frame).
        return self._forward_eagerly(_compile.current_callback(), args, kwargs)

    @torch.compiler.disable
    def _forward_eagerly(self, callback, args, kwargs):
        _guards.check_outer_torch_ddp(self)
        _guards.check_params_unchanged(self)
        self._engine.check_before_forward()
        compiling = _compile.is_compiling_callback(callback)
        _compile.refuse_compiled_autograd(compiling)
        # Under optim_grads_params each compiled section gathers its own units (meshddp/_compiled_sections.py).
        split = _compile.split_callback(self, callback, self._wrap_section)
        if self._shards_params:
            _compiled_sections.refuse_unsupported(self.module, compiling, split is not callback)
        if self._engine.pending_param_gathers() > 0 and (compiling or _compile.may_run_compiled_code(self.module)):
            self._engine.finish_param_gathers()
        scope = self._engine.open_forward_scope()
        try:
            output = _compile.call_with_callback(self.module, args, kwargs, split)
        finally:
            del scope
        if self._find_unused:
            self._engine.mark_unused([t for t in tree_leaves(output) if isinstance(t, torch.Tensor)])
        return output

    def _param_buckets(self):
        """id(param) -> the global index (launch order) of its bucket, for every trainable param of
        the wrapped module (a DTensor param by the DTensor itself): where a compiled graph is split."""
        by_engine_name = dict(self._engine._param_buckets())
        out = {}
        for name, p in self.module.named_parameters():
            bucket = by_engine_name.get(self._engine_names.get(name, name))
            if bucket is not None:
                out[id(p)] = bucket
        return out

    def finish_grad_sync(self):
        """Launches every bucket not launched yet, in order, and waits for all (GIL released).
        Afterwards each param's .grad (main_grad) holds the DP mean. A second call in the same step is a
        no-op. Under meshddp.pipelining it is the stage's finish_grad_sync (the same gradients: the earlier
        schedule steps' added back when accumulating)."""
        if self._engine.grad_sync_finished():
            return  # the state stays as it is ("stepped" after an optimizer step on these gradients)
        before = self._before_finish() if self._before_finish is not None else None
        if before is not None:
            before()
        self._engine.finish_grad_sync()
        self._after_grad_sync()

    def _after_grad_sync(self):
        """After a finished sync (finish_grad_sync, finalize_model_grads): the gradients set aside by
        meshddp.pipelining's accumulation added back, and the buffers' state recorded."""
        if self._set_aside is not None:
            with torch.no_grad():
                for name, grad in self._set_aside:
                    self.main_grad(name).add_(grad)
            self._set_aside = None
        self._record_synced_grads()  # the gradients as synced (the add is meshddp's own, not a foreign write)
        self._grads_state = "synced"  # until zero_grad_buffer(); "stepped" after an optimizer step on them

    def _record_synced_grads(self):
        """ZeRO-1: the gradients are synced as they are now (DistributedOptimizer.step() refuses later writes
        by others, e.g. torch's clip_grad_norm_)."""
        self._synced_grad_version = sum(g._version for g in self._version_probes)

    def zero_grad_buffer(self):
        """Zeroes the gradient buffers and points every .grad back at them. Call it (not
        optimizer.zero_grad(), which would set the grads to None) before each step's first backward."""
        self._engine.zero_grad_buffer()
        self._synced_grad_version = None
        self._grads_state = "zeroed"
        self._set_aside = None  # an accumulation discarded: nothing of it comes back

    def _grads_written_since_sync(self):
        """ZeRO-1: whether the gradients were changed in place after this step's finish_grad_sync()."""
        version = self._synced_grad_version
        return version is not None and sum(g._version for g in self._version_probes) != version

    def set_is_last_microbatch(self, is_last):
        """Deprecated: set_requires_gradient_sync(is_last), the same switch."""
        _deprecated.warn("DistributedDataParallel.set_is_last_microbatch",
                         "DistributedDataParallel.set_requires_gradient_sync (or `with ddp.no_sync():`)")
        self._engine.set_requires_gradient_sync(bool(is_last))

    # -- the controls a pipeline schedule drives (docs/guide/pipelines.md) ------------------------------------
    def start_grad_sync(self):
        """Launches now, in bucket order, every bucket not launched yet (a param that got no gradient
        contributes its slot), without waiting: after a chunk's last backward micro-batch, so that its
        sync overlaps the other chunks' backward. finish_grad_sync() (or finalize_model_grads) waits."""
        self._engine.start_grad_sync()

    def set_requires_gradient_sync(self, requires_sync):
        """False: hold every bucket (backward only accumulates) until set True again, e.g. for every
        micro-batch but the last (FSDP2's name; torch DDP's and Megatron's no_sync() context is the same
        switch). Default True."""
        self._engine.set_requires_gradient_sync(bool(requires_sync))

    def scale_gradients(self, factor):
        """Multiplies the flat gradient buffers by `factor` (not p.grad, which with fp32 main grads or
        ZeRO-1 is not what the optimizer reads). Between micro-batches, or after finish_grad_sync() and
        before the optimizer step; a RuntimeError while a bucket collective is in flight."""
        self._engine.scale_gradients(float(factor))
        if self._synced_grad_version is not None:  # meshddp's own scaling of the synced buffers, not a foreign write
            self._record_synced_grads()

    def broadcast_params(self):
        """Every param takes DP rank 0's values over its reduction group (experts over expert-DP), then
        a weight tied across stages the first stage's copy. Collective; between steps."""
        self._engine.broadcast_params()

    def check_tied_params_identical(self):
        """A RuntimeError on both ends of the pipeline, naming the param, when the two copies of a weight
        tied across stages differ. Collective over the embedding group."""
        self._engine.check_tied_params_identical()

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside this context only accumulates into the buffer (torch DDP's no_sync())."""
        previous = self._engine.is_last_microbatch()
        self._engine.set_is_last_microbatch(False)
        try:
            yield
        finally:
            self._engine.set_is_last_microbatch(previous)

    # -- parameters and gradients -----------------------------------------------------------------
    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        """The wrapped module's parameters by their own names (no 'module.' prefix), deduplicated."""
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=True)

    def parameters(self, recurse=True):
        return (p for _, p in self.named_parameters(recurse=recurse))

    def state_dict(self, *args, **kwargs):
        """The module's state_dict, after pending param all-gathers finish (ZeRO-1 with
        overlap_param_gather: right after step() the params are still being gathered; the module's
        own state_dict() would read some of the previous step's values). Under
        data_parallel_sharding_strategy='optim_grads_params' a collective over DP that returns whole copies
        of the params (every unit gathered, copied, released: a transient whole model per rank), so that
        the checkpoint is the same under every strategy (Note [Whole-param state dicts under
        optim_grads_params], meshddp/_sharded_params.py)."""
        if self._shards_params:
            return _sharded_params.state_dict(self, *args, **kwargs)
        self._engine.finish_param_gathers()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """The module's load_state_dict (values copied into the params in place), between steps (not
        while a gradient sync is pending). With the distributed optimizer, pending param all-gathers
        finish first and the optimizer's fp32 master weights are refreshed from the loaded params
        before its next step (else the step would write the old weights back). assign=True is refused:
        it would replace the params, which are views of meshddp's flat buffers. Under
        data_parallel_sharding_strategy='optim_grads_params' each rank writes its shards of the given whole
        tensors (not collective)."""
        if assign:
            raise _error("load_state_dict(assign=True) would replace the parameters, but each is a view of "
                         "meshddp's flat buffers; load with assign=False (the default: values copied in place)")
        if self._shards_params:
            return _sharded_params.load_state_dict(self, state_dict, strict=strict)
        self._engine.before_params_written("meshddp.DistributedDataParallel.load_state_dict")
        try:
            return self.module.load_state_dict(state_dict, strict=strict)
        finally:
            self._engine.notify_params_changed()  # also after a partial load (strict=True that failed midway)

    def _load_as_submodule(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        """load_state_dict's pre-hook when this wrapper is loaded as another module's submodule: the keys
        under `prefix` are renamed to the wrapped module's ('module.' inserted), as load_state_dict() takes them."""
        if local_metadata.get("assign_to_params_buffers", False):
            raise _error("load_state_dict(assign=True) would replace the parameters, but each is a view of "
                         "meshddp's flat buffers; load with assign=False (the default: values copied in place)")
        if self._shards_params:
            raise _error("loaded as a submodule (e.g. torch.compile(ddp).load_state_dict) under "
                         "data_parallel_sharding_strategy='optim_grads_params', which keeps only shards of the params: "
                         "call load_state_dict on the DistributedDataParallel itself, which writes the shards")
        self._engine.before_params_written("meshddp.DistributedDataParallel.load_state_dict")
        for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + "module.")]:
            state_dict[prefix + "module." + key[len(prefix):]] = state_dict.pop(key)

    def main_grad(self, name):
        """The synced gradient of trainable param `name` (module path): a view of its slot in the flat
        buffer, shaped like the param's local tensor (fp32 with grad_reduce_in_fp32). Refused under
        data_parallel_sharding_strategy='optim_grads', which keeps no whole gradient."""
        if self._shards_grads:
            raise _grad_shards.no_whole_main_grad(f"ddp.main_grad('{name}')", name, self._strategy)
        return self._engine.main_grad(self._engine_names.get(name, name))

    @property
    def config(self):
        return self._engine.config

    def param_storage_bytes(self):
        """Bytes of param storage this rank holds now (trainable params). Under
        data_parallel_sharding_strategy='optim_grads_params' its shards plus the FSDP units in use or being
        gathered (between steps: the shards alone, param_shard_bytes()); under the other strategies the
        whole params (the flat param buffer with the distributed optimizer)."""
        return self._engine.param_storage_bytes()

    def peak_param_storage_bytes(self):
        """The most param_storage_bytes() has been since construction or reset_peak_param_storage()."""
        return self._engine.peak_param_storage_bytes()

    def reset_peak_param_storage(self):
        self._engine.reset_peak_param_storage()

    def param_shard_bytes(self):
        """Bytes of this rank's param shards under 'optim_grads_params' (1/DP of the padded buckets); the
        whole params under the other strategies, which do not shard them."""
        return self._engine.param_shard_bytes()

    def grad_buffer_bytes(self):
        """Bytes of the flat gradient buffers (the gradients' only long-lived home); under
        data_parallel_sharding_strategy='optim_grads' this rank's gradient shards plus the whole-bucket
        blocks allocated for the buckets in flight."""
        return self._engine.grad_buffer_bytes()
