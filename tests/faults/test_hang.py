"""Scenario 6: a worker stops responding before a collective.

The other rank must fail within the collective timeout, with an error that names the silent
rank and says what this rank last issued, through either transport: shm (our own barrier
timeout) and gloo (the process group's timeout, explained through the store afterwards).
"""

import datetime
import time

import pytest
import torch.distributed as dist

from dpscale.lab.multirank import MultiRankError, run_ranks
from dpscale.testing.faults import FaultInjector
from dpscale.train.config import TrainConfig
from dpscale.train.trainer import Trainer
from support.timing import process_baseline_s

# starts processes (spawned ranks); waits: on the silent rank, then the collective timeout
pytestmark = [pytest.mark.slow, pytest.mark.waits]

TIMEOUT_S = 2


def train_with_own_group(rank, world, cfg, store_path):
    # the group's timeout is what bounds gloo collectives: set it from the config, as the launcher does
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=cfg["collective_timeout_s"]),
    )
    try:
        return Trainer(TrainConfig.from_flat(**cfg), callbacks=[FaultInjector()]).fit().steps
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_silent_rank_is_named_within_the_timeout(tmp_path, transport):
    cfg = dict(
        workload="synthetic",
        max_steps=6,
        progress="none",
        transport=transport,
        collective_timeout_s=TIMEOUT_S,
    )
    slack_s = 6 * process_baseline_s()  # ~16 s quiet, more under load
    t0 = time.monotonic()
    with pytest.raises(MultiRankError) as err:
        run_ranks(
            train_with_own_group,
            2,
            cfg,
            str(tmp_path / "store"),
            backend=None,
            timeout_s=120,
            env={"DPSCALE_FAULTS": "hang@step=3,rank=1"},
        )
    elapsed = time.monotonic() - t0
    report = str(err.value)
    rank0 = report[report.index("--- rank 0") : report.index("--- rank 1")]
    assert "CollectiveError: rank 0: a collective failed" in rank0, report
    assert f"rank 1 did not report within {TIMEOUT_S} s" in rank0, report
    # what rank 0 was doing: step 3's first gradient bucket, after step 2's flags
    assert "this rank last issued (oldest first):" in rank0
    assert "all_reduce of step flags" in rank0 and "all_reduce of bucket 0" in rank0, rank0
    if transport == "shm":
        assert "waited 2 s for rank 1" in rank0  # the transport's own words, kept as the cause
    # timeout + the wait for reports + the harness's grace period, in process starts of this host now
    assert elapsed < TIMEOUT_S + slack_s, (elapsed, slack_s)
