"""dpscale: data-parallel training on PyTorch that tells you how it scales."""

from .engine import DistributedDataParallel

__version__ = "0.1.0"

__all__ = ["DistributedDataParallel", "__version__"]
