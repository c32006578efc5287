"""Data for data parallelism: which samples each rank sees at each step."""

from dpscale.data.sampler import TAIL_POLICIES, GlobalBatchSampler, StepBatch

__all__ = ["TAIL_POLICIES", "GlobalBatchSampler", "StepBatch"]
