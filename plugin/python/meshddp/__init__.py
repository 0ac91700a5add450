"""meshddp for Python trainers: DistributedDataParallel and a ZeRO-1 DistributedOptimizer over a
torch DeviceMesh, with meshddp's C++ engine (flat gradient buffers, bucketed overlapped collectives)
doing the work. See docs/python.md."""

import torch  # loads libtorch and torch's pybind11 types before the extension

from meshddp import _torch_version
from meshddp._version import __version__, built_with_cuda, built_with_torch

_torch_version.check(built_with_torch, torch.__version__, __version__, built_with_cuda)  # before the engine loads

import torch.distributed  # noqa: E402,F401  (registers c10d's ProcessGroup type for the extension)

from meshddp._C import DdpConfig, OptimizerConfig, StepResult, linear_with_grad_in_buffer  # noqa: E402
from meshddp.ddp import DistributedDataParallel  # noqa: E402
from meshddp.optimizer import DistributedOptimizer  # noqa: E402

__all__ = [
    "__version__",
    "built_with_cuda",
    "built_with_torch",
    "DdpConfig",
    "DistributedDataParallel",
    "DistributedOptimizer",
    "OptimizerConfig",
    "StepResult",
    "linear_with_grad_in_buffer",
]
