"""dpscale: data-parallel training on PyTorch that tells you how it scales."""

from dpscale.data import GlobalBatchSampler
from dpscale.engine import DistributedDataParallel
from dpscale.train.config import TrainConfig
from dpscale.train.result import TrainResult
from dpscale.train.trainer import Trainer
from dpscale.version import __version__
from dpscale.workloads.task import Task

__all__ = [
    "DistributedDataParallel",
    "GlobalBatchSampler",
    "Task",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "__version__",
]
