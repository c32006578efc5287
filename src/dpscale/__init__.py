"""dpscale: data-parallel training on PyTorch that tells you how it scales."""

from dpscale.torch_range import check_running_torch

# before anything else imports torch's internals: a torch older than the supported range is one
# line naming the release to install, not whichever private name fails first (torch_range.py)
check_running_torch()

from dpscale.data import GlobalBatchSampler  # noqa: E402
from dpscale.engine import DistributedDataParallel  # noqa: E402
from dpscale.train.config import (  # noqa: E402
    AdaptiveConfig,
    CheckpointConfig,
    DataConfig,
    EngineConfig,
    MetricsConfig,
    OptimConfig,
    TrainConfig,
)
from dpscale.train.result import TrainResult  # noqa: E402
from dpscale.train.trainer import Trainer  # noqa: E402
from dpscale.version import __version__  # noqa: E402
from dpscale.workloads.task import Task  # noqa: E402

__all__ = [
    "AdaptiveConfig",
    "CheckpointConfig",
    "DataConfig",
    "DistributedDataParallel",
    "EngineConfig",
    "MetricsConfig",
    "OptimConfig",
    "GlobalBatchSampler",
    "Task",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "__version__",
]
