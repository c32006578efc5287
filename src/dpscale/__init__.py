"""dpscale: data-parallel training on PyTorch that tells you how it scales."""

from .data import GlobalBatchSampler
from .engine import DistributedDataParallel
from .train.config import TrainConfig
from .train.result import TrainResult
from .train.trainer import Trainer
from .version import __version__
from .workloads.task import Task

__all__ = [
    "DistributedDataParallel",
    "GlobalBatchSampler",
    "Task",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "__version__",
]
