"""Scenario 9: one rank's parameter is changed outside the synchronized step.

The drift check every K steps must stop the run at the first check after the change, on every
rank, naming the parameter and the rank that differs.
"""

import pytest

from dpscale.lab.multirank import MultiRankError, run_ranks
from dpscale.testing.faults import FaultInjector
from dpscale.train.config import TrainConfig
from dpscale.train.trainer import Trainer

pytestmark = pytest.mark.slow  # starts processes (spawned ranks or the CLI)


def fit(rank, world, cfg):
    return Trainer(TrainConfig.from_flat(**cfg), callbacks=[FaultInjector()]).fit().steps


def test_perturbed_parameter_stops_the_run_within_one_check_interval():
    cfg = dict(workload="synthetic", max_steps=20, drift_check_every=5, progress="none")
    with pytest.raises(MultiRankError) as err:
        run_ranks(
            fit, 2, cfg, timeout_s=60, env={"DPSCALE_FAULTS": "perturb@step=7,rank=1,param=net.2.weight"}
        )
    report = str(err.value)
    for rank in (0, 1):  # both ranks see the same fingerprints, so both stop at the same check
        section = report.split(f"--- rank {rank}")[1]
        assert (
            "ReplicaDriftError: replicas drifted by step 10: 'net.2.weight' on rank 1 differs from rank 0"
            in (section)
        ), report
        assert "1 of 6 parameters and buffers differ" in section
