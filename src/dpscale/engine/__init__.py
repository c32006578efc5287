"""The data-parallel engine: bucket layout, readiness tracking, communication hooks."""

from dpscale.engine.ddp import DistributedDataParallel
from dpscale.engine.hooks import GradBucket, allreduce_hook, bf16_compress_hook, fp16_compress_hook
from dpscale.engine.stats import StepStats

__all__ = [
    "DistributedDataParallel",
    "GradBucket",
    "StepStats",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
]
