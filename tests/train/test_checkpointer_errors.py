"""A resume that fails: bad input (the checkpoint does not fit) is refused, a file system error is not.

A ConfigError from a worker is taken as bad input: one line, exit 2, no restart (launch/worker.py).
An I/O error while resuming (flaky network storage, a file missing on one host) may pass on the
next attempt, so it must stay an ordinary failure the agent restarts.
"""

import pytest
import torch
import torch.distributed as dist

from dpscale.engine.collective_log import CollectiveLog
from dpscale.errors import ConfigError
from dpscale.train.checkpoint.checkpointer import Checkpointer, CheckpointUnreadable
from dpscale.train.checkpoint.files import CheckpointError


@pytest.fixture
def checkpointer(tmp_path):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        log = CollectiveLog(None)
        ck = Checkpointer(tmp_path, group=None, log=log, keep_last=2, expected_stems=["model"])
        ck.save(1, {"model": torch.nn.Linear(2, 1)})
        yield ck
    finally:
        dist.destroy_process_group()


def _apply_raising(error):
    def apply(loaded):
        raise error

    return apply


def test_a_checkpoint_that_does_not_fit_is_bad_input(checkpointer):
    with pytest.raises(CheckpointError, match="size mismatch"):
        checkpointer.resume(_apply_raising(RuntimeError("size mismatch for weight")))


def test_a_file_system_error_while_resuming_is_a_failure_to_restart_not_bad_input(checkpointer):
    with pytest.raises(CheckpointUnreadable, match="Input/output error") as err:
        checkpointer.resume(_apply_raising(OSError(5, "Input/output error")))
    assert not isinstance(err.value, ConfigError)
