"""Scenario 7: ranks that would issue different collectives get a clear error, not a hang.

Different model shapes and different bucket layouts are caught when the engine is built; a
setting that changes the collectives themselves (here a comm hook on one rank only) is caught by
the collective check before the mismatched collective is issued, naming both sides.
"""

import pytest
import torch
from torch import nn

from dpscale.engine import DistributedDataParallel, fp16_compress_hook
from dpscale.engine.collective_log import CollectiveLog
from dpscale.lab.multirank import MultiRankError, run_ranks

pytestmark = pytest.mark.slow  # starts processes (spawned ranks or the CLI)


def build_model(rank, world, hidden_by_rank, bucket_cap_mb_by_rank):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, hidden_by_rank[rank]), nn.ReLU(), nn.Linear(hidden_by_rank[rank], 2))
    DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb_by_rank[rank], first_bucket_cap_mb=0.0001)


def test_different_model_shapes_fail_at_construction_naming_the_parameter():
    with pytest.raises(MultiRankError) as err:
        run_ranks(build_model, 2, [16, 32], [25, 25], timeout_s=60)
    report = str(err.value)
    for rank in (0, 1):  # every rank raises, none is left waiting
        section = report.split(f"--- rank {rank}")[1]
        assert "ValueError: model differs between ranks 0 and 1 at parameter #0" in section, report
    assert "'0.weight' of shape [16, 64]" in report and "'0.weight' of shape [32, 64]" in report


def test_different_bucket_layouts_fail_at_construction():
    # after a ~100-byte first bucket, 25 MB buckets on rank 0 hold the remaining layers together,
    # ~1 KB buckets on rank 1 split off the 8 KB first-layer weight
    with pytest.raises(MultiRankError) as err:
        run_ranks(build_model, 2, [32, 32], [25, 0.001], timeout_s=60)
    report = str(err.value)
    assert "ValueError: gradient buckets differ between ranks 0 and 1" in report, report
    assert "pass the same bucket_cap_mb" in report


def hook_on_rank_1(rank, world):
    torch.manual_seed(0)
    log = CollectiveLog()
    log.verify = True  # what the trainer does for its first step
    model = DistributedDataParallel(nn.Linear(8, 2), transport="gloo", collective_log=log)
    if rank == 1:
        model.register_comm_hook(None, fp16_compress_hook)
    model(torch.randn(4, 8)).sum().backward()


def test_collectives_that_differ_between_ranks_are_named_before_they_run():
    with pytest.raises(MultiRankError) as err:
        run_ranks(hook_on_rank_1, 2, timeout_s=60)
    report = str(err.value)
    expected = (
        "CollectiveMismatchError: ranks issue different collectives: rank 0 issues #3 all_reduce of "
        "bucket 0 (18 x float32), rank 1 issues #3 comm_hook of bucket 0 (18 x float32)"
    )
    for rank in (0, 1):
        assert expected in report.split(f"--- rank {rank}")[1], report
