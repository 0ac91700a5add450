"""meshddp for Python trainers: DistributedDataParallel and a ZeRO-1 DistributedOptimizer over a
torch DeviceMesh, with meshddp's C++ engine (flat gradient buffers, bucketed overlapped collectives)
doing the work. See docs/python.md."""

import torch  # loads libtorch and torch's pybind11 types before the extension

from meshddp import _torch_version
from meshddp._version import __version__, built_with_cuda, built_with_torch

_torch_version.check(built_with_torch, torch.__version__, __version__, built_with_cuda)  # before the engine loads

import torch.distributed  # noqa: E402,F401  (registers c10d's ProcessGroup type for the extension)

from meshddp._C import DdpConfig, LrScheduleConfig, OptimizerConfig, StepResult, linear_with_grad_in_buffer  # noqa: E402
from meshddp._C import lr_at, weight_decay_at  # noqa: E402
from meshddp._C import (  # noqa: E402  (which ranks share a param: mesh/reduction_groups.h)
    cross_instance_groups,
    expert_data_parallel_groups,
    expert_parallel_groups,
    flattened_group_ranks,
    flattened_groups,
    optimizer_instance_groups,
)
from meshddp._dcp_stager import DcpStager  # noqa: E402
from meshddp.ddp import DistributedDataParallel  # noqa: E402
from meshddp.pipeline import declare_tied_across_stages, embedding_groups, finalize_model_grads  # noqa: E402
from meshddp.optimizer import DistributedOptimizer  # noqa: E402
from meshddp.training import LrScheduler, clip_grad_norm_, grad_norm  # noqa: E402

__all__ = [
    "__version__",
    "built_with_cuda",
    "built_with_torch",
    "DcpStager",
    "DdpConfig",
    "DistributedDataParallel",
    "DistributedOptimizer",
    "LrScheduleConfig",
    "LrScheduler",
    "OptimizerConfig",
    "StepResult",
    "clip_grad_norm_",
    "cross_instance_groups",
    "declare_tied_across_stages",
    "embedding_groups",
    "expert_data_parallel_groups",
    "expert_parallel_groups",
    "finalize_model_grads",
    "flattened_group_ranks",
    "flattened_groups",
    "grad_norm",
    "linear_with_grad_in_buffer",
    "lr_at",
    "optimizer_instance_groups",
    "weight_decay_at",
]
