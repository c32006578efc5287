"""dpscale: data-parallel training on PyTorch that tells you how it scales."""

from .data import GlobalBatchSampler
from .engine import DistributedDataParallel
from .train.config import TrainConfig
from .train.trainer import Trainer, TrainResult
from .workloads.task import Task

__version__ = "0.1.0"

__all__ = [
    "DistributedDataParallel",
    "GlobalBatchSampler",
    "Task",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "__version__",
]
