"""dpscale: data-parallel training on PyTorch that tells you how it scales.

The public names below are imported on first use (PEP 562's module `__getattr__`), so that
`import dpscale` (and the `dpscale` command, which installs its signal handlers first thing) does
not wait seconds for torch: a signal in a command's first second is then handled like any other.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dpscale.torch_range import check_running_torch

# before anything else imports torch's internals: a torch older than the supported range is one
# line naming the release to install, not whichever private name fails first (torch_range.py)
check_running_torch()

if TYPE_CHECKING:
    from dpscale.data import GlobalBatchSampler
    from dpscale.engine import DistributedDataParallel
    from dpscale.train.config import (
        AdaptiveConfig,
        CheckpointConfig,
        DataConfig,
        EngineConfig,
        MetricsConfig,
        OptimConfig,
        TrainConfig,
    )
    from dpscale.train.result import TrainResult
    from dpscale.train.trainer import Trainer
    from dpscale.version import __version__
    from dpscale.workloads.task import Task

# each public name -> the module that defines it
_WHERE = {
    "AdaptiveConfig": "dpscale.train.config",
    "CheckpointConfig": "dpscale.train.config",
    "DataConfig": "dpscale.train.config",
    "DistributedDataParallel": "dpscale.engine",
    "EngineConfig": "dpscale.train.config",
    "MetricsConfig": "dpscale.train.config",
    "OptimConfig": "dpscale.train.config",
    "GlobalBatchSampler": "dpscale.data",
    "Task": "dpscale.workloads.task",
    "TrainConfig": "dpscale.train.config",
    "TrainResult": "dpscale.train.result",
    "Trainer": "dpscale.train.trainer",
    "__version__": "dpscale.version",
}

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


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'dpscale' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
