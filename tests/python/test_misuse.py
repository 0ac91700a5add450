"""Misuse from Python: each a RuntimeError (or TypeError for a wrong keyword) naming the problem,
with the C++ engine's own text where the check is C++'s. One rank, in this process.

What the cases check:
- wrong dim name, a non-DeviceMesh argument, a forward before finish_grad_sync(), config errors with the C++
  text, ZeRO-1 without use_distributed_optimizer, a DTensor .grad set to None, optimizer instances that do not
  divide DP or without a mesh
"""


import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import meshddp


def model():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def test_wrong_dim_name_names_the_dims(mesh):
    with pytest.raises(RuntimeError, match=r"no dim named 'data'.*\('dp', 'tp'\)"):
        meshddp.DistributedDataParallel(model(), mesh, dp_dim="data")


def test_non_device_mesh_argument_names_the_type(mesh):
    with pytest.raises(RuntimeError, match=r"mesh must be a torch.distributed.device_mesh.DeviceMesh.*got str"):
        meshddp.DistributedDataParallel(model(), "dp")
    with pytest.raises(RuntimeError, match=r"process_group must be a torch.distributed.ProcessGroup, got DeviceMesh"):
        meshddp.DistributedDataParallel(model(), process_group=mesh)


def test_forward_before_finish_grad_sync_names_the_params(mesh):
    ddp = meshddp.DistributedDataParallel(model(), mesh, config=meshddp.DdpConfig(bucket_bytes=0))
    ddp.zero_grad_buffer()
    x = torch.randn(3, 4)
    out = ddp(x)
    out.sum().backward()
    with pytest.raises(RuntimeError, match=r"DistributedDataParallel::forward: a new step began before "
                                           r"finish_grad_sync\(\)"):
        ddp(x)
    ddp.finish_grad_sync()
    ddp.zero_grad_buffer()
    ddp(x)  # fine again


def test_config_errors_carry_the_cpp_text():
    with pytest.raises(RuntimeError, match=r"DdpConfig: bucket_bytes = -1 is negative"):
        meshddp.DdpConfig(bucket_bytes=-1)  # a size: refused by its conversion, at once
    with pytest.raises(RuntimeError, match=r"GradBufferConfig: bucket_bytes = 2199023255552 \(over 1 TiB\)"):
        meshddp.DdpConfig(bucket_bytes=1 << 41).validate()
    with pytest.raises(TypeError, match=r"DdpConfig: no field 'bucket_size'; the fields are .*bucket_bytes"):
        meshddp.DdpConfig(bucket_size=1)
    with pytest.raises(RuntimeError, match=r"DistributedOptimizerConfig: lr must be > 0, got -1"):
        meshddp.DistributedOptimizerConfig(lr=-1.0).validate()
    with pytest.raises(RuntimeError, match=r"OptimizerConfig: kind must be one of 'adamw', 'sgd', 'muon', got 'adam'"):
        meshddp.DistributedOptimizerConfig(kind="adam")
    c = meshddp.DdpConfig(bucket_bytes=1 << 20, overlap_grad_reduce=False)
    assert c.bucket_bytes == 1 << 20 and not c.overlap_grad_reduce
    assert meshddp.DdpConfig().comm_hook == "none"
    assert meshddp.DdpConfig(comm_hook="bf16_compress").comm_hook == "bf16_compress"
    with pytest.raises(RuntimeError, match=r"comm_hook = 'bf16' is not a built-in communication hook"):
        meshddp.DdpConfig(comm_hook="bf16").validate()


# A non-default value for every config field, keyed by name. The key set must equal the C++ field list
# (field_names() reads kDdpConfigFields / kOptimizerConfigFields), so a new C++ field fails this test
# until it is given a value here, and is then checked to be settable, readable and in repr().
_FIELD_VALUES = {
    meshddp.DdpConfig: dict(
        bucket_bytes=1 << 20, overlap_grad_reduce=False, grad_reduce_in_fp32=True, pad_for_reduce_scatter=True,
        find_unused_parameters=True, use_distributed_optimizer=True, gradient_accumulation_fusion=False,
        check_for_nan_in_grad=True, comm_hook="bf16_compress", num_distributed_optimizer_instances=2,
        broadcast_from_rank0=False,
        verify_model_across_ranks=False, broadcast_buffers=False, tp_replica_check_interval=7,
        expert_parallel_size=2, virtual_pipeline_size=3, virtual_pipeline_chunk=2, shard_policy="whole_param",
        data_parallel_sharding_strategy="optim_grads", fsdp_unit_modules="blocks.*"),
    meshddp.DistributedOptimizerConfig: dict(
        kind="sgd", lr=0.25, weight_decay=0.5, beta1=0.5, beta2=0.75, eps=1e-6, momentum=0.875,
        groups=[("*.bias", None, 0.0), ("*norm*", 0.125, None)], clip_grad_norm=1.5, overlap_param_gather=True,
        fused_step="never", muon_momentum=0.5, muon_nesterov=False, muon_ns_steps=3, muon_ns_coefficients="quintic",
        muon_ns_dtype="fp32", muon_scale="spectral", muon_extra_scale=0.5, muon_eps=1e-6, muon_adamw_params="*wte*",
        muon_stacked_matrices=True),
}


@pytest.mark.parametrize("cls", [meshddp.DdpConfig, meshddp.DistributedOptimizerConfig], ids=lambda c: c.__name__)
def test_every_config_field_is_settable_readable_and_in_repr(cls):
    values = _FIELD_VALUES[cls]
    assert sorted(cls.field_names()) == sorted(values), "give every C++ field a non-default value in _FIELD_VALUES"
    default = cls()
    by_keyword = cls(**values)
    text = repr(by_keyword)
    for name, value in values.items():
        assert getattr(default, name) != value, name  # a non-default value, so setting it is visible
        assert getattr(by_keyword, name) == value, name
        assert f"{name}={value!r}" in text, (name, text)
        by_property = cls()
        setattr(by_property, name, value)
        assert getattr(by_property, name) == value, name
    assert text.startswith(cls.__name__ + "(") and text.count("=") == len(values), text


def test_config_properties_are_typed_at_once_and_validated_by_validate():
    """A wrong type is refused where it is set; a range by validate(), which the wrappers call after the
    ranks agreed on the config (test_config_agreement.py)."""
    c = meshddp.DdpConfig()
    c.tp_replica_check_interval = -1
    with pytest.raises(RuntimeError, match=r"DdpConfig: tp_replica_check_interval must be >= 0, got -1"):
        c.validate()
    with pytest.raises(TypeError, match=r"DdpConfig: check_for_nan_in_grad must be True or False, got 'yes'"):
        meshddp.DdpConfig(check_for_nan_in_grad="yes")
    with pytest.raises(TypeError, match=r"DdpConfig: tp_replica_check_interval must be an int, got True"):
        meshddp.DdpConfig(tp_replica_check_interval=True)
    with pytest.raises(TypeError, match=r"DdpConfig: comm_hook must be a str, got 3"):
        meshddp.DdpConfig(comm_hook=3)
    with pytest.raises(TypeError, match=r"OptimizerConfig: groups must be a list of \(pattern, lr or None, "
                                        r"weight_decay or None\), got \[\('\*.bias',\)\]"):
        meshddp.DistributedOptimizerConfig(groups=[("*.bias",)])
    with pytest.raises(RuntimeError, match=r"OptimizerConfig: fused_step must be one of 'auto', 'always', 'never', "
                                           r"got 'sometimes'"):
        meshddp.DistributedOptimizerConfig(fused_step="sometimes")
    c = meshddp.DistributedOptimizerConfig()
    c.beta1 = 1.5
    with pytest.raises(RuntimeError, match=r"DistributedOptimizerConfig: beta1 must be in \[0, 1\), got 1.5"):
        c.validate()


def test_the_tp_dim_rule_is_the_cpp_one(mesh):
    assert meshddp._C.tp_dim_of(["dp", "pp", "tp"], [2, 1, 2], "dp") == "tp"
    assert meshddp._C.tp_dim_of(["dp", "tp"], [2, 1], "dp") == ""
    # A 3-D mesh whose other dims have one rank each: no TP dim to pick, no error (Python asked for
    # tp_dim= here before, where C++ took the one dim with more than one rank).
    three_d = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp", "pp", "tp"))
    ddp = meshddp.DistributedDataParallel(model(), three_d)
    assert ddp.tp_dim is None


def test_distributed_optimizer_needs_use_distributed_optimizer(mesh):
    ddp = meshddp.DistributedDataParallel(model(), mesh)
    with pytest.raises(RuntimeError, match=r"DistributedOptimizer: the gradient buffer was built without "
                                           r"use_distributed_optimizer"):
        meshddp.DistributedOptimizer(ddp, meshddp.DistributedOptimizerConfig())


def test_optimizer_instances_that_do_not_fit_are_refused_with_the_cpp_text(mesh):
    # Hierarchical ZeRO-1 from Python (its groups from the mesh, test_torch_surface.py): without
    # use_distributed_optimizer, or with more instances than DP ranks, the C++ text.
    with pytest.raises(RuntimeError, match=r"num_distributed_optimizer_instances = 2 needs use_distributed_optimizer"):
        meshddp.DistributedDataParallel(model(), mesh, config=meshddp.DdpConfig(num_distributed_optimizer_instances=2))
    config = meshddp.DdpConfig(use_distributed_optimizer=True, num_distributed_optimizer_instances=2)
    with pytest.raises(RuntimeError, match=r"hierarchical ZeRO-1: 2 optimizer instances do not divide the 1 ranks of "
                                           r"each dp group"):
        meshddp.DistributedDataParallel(model(), mesh, config=config)
    pg = torch.distributed.distributed_c10d._get_default_group()
    with pytest.raises(RuntimeError, match=r"num_distributed_optimizer_instances = 2 needs the DeviceMesh \(mesh=\)"):
        meshddp.DistributedDataParallel(model(), process_group=pg, config=config)


def test_dtensor_grad_set_to_none_is_named(mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    m = model()
    parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(output_layouts=None)})
    ddp = meshddp.DistributedDataParallel(m, mesh)
    ddp.zero_grad_buffer()
    m[0].weight.grad = None  # what torch's optimizer.zero_grad() does
    with pytest.raises(RuntimeError, match=r"DTensor parameter '0.weight' got a gradient while its \.grad was not"):
        F.mse_loss(ddp(torch.randn(3, 4)), torch.zeros(3, 2)).backward()


def test_a_process_that_ends_in_std_terminate_prints_the_cpp_backtrace():
    # "terminate called without an active exception" alone says nothing; importing meshddp installs a
    # std::terminate handler that writes the C++ backtrace first, then runs the previous handler.
    import signal
    import subprocess
    import sys

    code = "import ctypes, meshddp; ctypes.CDLL('libstdc++.so.6')['_ZSt9terminatev']()"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == -signal.SIGABRT, (run.returncode, run.stderr)
    assert "meshddp: std::terminate was called" in run.stderr, run.stderr
    assert "backtrace" in run.stderr and "libstdc++" in run.stderr, run.stderr
    assert "terminate called without an active exception" in run.stderr, run.stderr  # the previous handler ran too
