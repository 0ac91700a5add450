"""meshddp for Python trainers: DistributedDataParallel and a ZeRO-1 DistributedOptimizer over a
torch DeviceMesh, with meshddp's C++ engine (flat gradient buffers, bucketed overlapped collectives)
doing the work. See docs/guide/python.md; the API: docs/reference/python_api.md.

Modules: meshddp.pipelining (pipeline parallel: finalize_model_grads, PipelineStage), meshddp.groups
(rank arithmetic: which ranks share a parameter's reduction)."""

import importlib

import torch  # loads libtorch and torch's pybind11 types before the extension

from meshddp import _torch_version
from meshddp._version import __version__, built_with_cuda, built_with_torch

_torch_version.check(built_with_torch, torch.__version__, __version__, built_with_cuda)  # before the engine loads

import torch.distributed  # noqa: E402,F401  (registers c10d's ProcessGroup type for the extension)

from meshddp import _deprecated, groups  # noqa: E402,F401
from meshddp._C import DdpConfig, DistributedOptimizerConfig, LrScheduleConfig, StepResult  # noqa: E402
from meshddp._C import linear_with_grad_in_buffer, lr_at, weight_decay_at  # noqa: E402
from meshddp._dcp_stager import DcpStager  # noqa: E402
from meshddp.ddp import DistributedDataParallel  # noqa: E402
from meshddp.optimizer import DistributedOptimizer  # noqa: E402
from meshddp.training import LrScheduler, clip_grad_norm_, grad_norm  # noqa: E402

OptimizerConfig = DistributedOptimizerConfig  # the short name, an alias (C++: meshddp::OptimizerConfig)

# Pipeline functions live in meshddp.pipelining, loaded on first use (it imports torch's pipelining).
_PIPELINING = ("finalize_model_grads", "declare_tied_across_stages")

# Old top-level names, kept for one release: each warns naming its new home.
_RENAMED = {
    name: (f"meshddp.groups.{name}", (lambda n: lambda: getattr(importlib.import_module("meshddp.groups"), n))(name))
    for name in ("cross_instance_groups", "embedding_groups", "expert_data_parallel_groups", "expert_parallel_groups",
                 "flattened_group_ranks", "flattened_groups", "optimizer_instance_groups")
}


def __dir__():
    """The module's names and those loaded on first use (dir(), help(), completion); not the deprecated ones."""
    return sorted(set(globals()) | set(_PIPELINING) | {"pipelining"})


def __getattr__(name):
    if name == "pipelining":
        return importlib.import_module("meshddp.pipelining")
    if name in _PIPELINING:
        return getattr(importlib.import_module("meshddp.pipelining"), name)
    return _deprecated.module_getattr(__name__, _RENAMED, name)


__all__ = [
    "__version__",
    "built_with_cuda",
    "built_with_torch",
    "DcpStager",
    "DdpConfig",
    "DistributedDataParallel",
    "DistributedOptimizer",
    "DistributedOptimizerConfig",
    "LrScheduleConfig",
    "LrScheduler",
    "OptimizerConfig",
    "StepResult",
    "clip_grad_norm_",
    "declare_tied_across_stages",
    "finalize_model_grads",
    "grad_norm",
    "linear_with_grad_in_buffer",
    "lr_at",
    "weight_decay_at",
]
