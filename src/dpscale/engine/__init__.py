"""The data-parallel engine: bucket layout, readiness tracking, communication hooks."""

from .ddp import DistributedDataParallel
from .hooks import GradBucket, allreduce_hook, bf16_compress_hook, fp16_compress_hook
from .stats import StepStats

__all__ = [
    "DistributedDataParallel",
    "GradBucket",
    "StepStats",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
]
