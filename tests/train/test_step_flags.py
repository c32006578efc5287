"""The step's flags collective: the loss, the skip and stop decisions, and the counts kept from them."""

import pytest
import torch
import torch.distributed as dist

from dpscale.engine.collective_log import CollectiveLog
from dpscale.train.step_flags import StepFlags


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _flags(stop=None):
    return StepFlags(group=None, world_size=1, log=CollectiveLog(None), stop_requested=stop)


def test_a_finite_step_is_kept_and_its_loss_and_norm_come_back(world_of_one):
    flags = _flags()
    loss = torch.tensor(6.0, dtype=torch.float64)
    decision = flags.reduce(loss, torch.tensor(1.5), small_sq=2.0)
    assert not decision.skipped and float(decision.loss_sum) == 6.0 and decision.small_sq == 2.0
    assert flags.skipped_in_a_row == 0 and not flags.stop_agreed


def test_non_finite_steps_count_in_a_row_until_a_finite_one(world_of_one):
    flags = _flags()
    loss = torch.tensor(1.0, dtype=torch.float64)
    for n in (1, 2):
        assert flags.reduce(loss, torch.tensor(float("inf")), small_sq=None).skipped
        assert flags.skipped_in_a_row == n
    assert not flags.reduce(loss, torch.tensor(1.0), small_sq=None).skipped
    assert flags.skipped_in_a_row == 0


def test_a_stop_request_is_agreed_after_the_step(world_of_one):
    flags = _flags(stop=lambda: "SIGTERM")
    flags.reduce(torch.tensor(1.0, dtype=torch.float64), torch.tensor(1.0), small_sq=None)
    assert flags.stop_agreed and flags.stop_requested() == "SIGTERM"
