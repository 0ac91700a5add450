"""meshddp for Python trainers: DistributedDataParallel and a ZeRO-1 DistributedOptimizer over a
torch DeviceMesh, with meshddp's C++ engine (flat gradient buffers, bucketed overlapped collectives)
doing the work. See docs/python.md."""

import torch  # noqa: F401  (loads libtorch and torch's pybind11 types before the extension)
import torch.distributed  # noqa: F401  (registers c10d's ProcessGroup type for the extension)

from meshddp._C import DdpConfig, OptimizerConfig, StepResult, linear_with_grad_in_buffer
from meshddp.ddp import DistributedDataParallel
from meshddp.optimizer import DistributedOptimizer

__all__ = [
    "DdpConfig",
    "DistributedDataParallel",
    "DistributedOptimizer",
    "OptimizerConfig",
    "StepResult",
    "linear_with_grad_in_buffer",
]
