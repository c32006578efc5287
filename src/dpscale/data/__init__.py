"""Data for data parallelism: which samples each rank sees at each step."""

from .sampler import TAIL_POLICIES, GlobalBatchSampler, StepBatch

__all__ = ["TAIL_POLICIES", "GlobalBatchSampler", "StepBatch"]
