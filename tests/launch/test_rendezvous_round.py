"""dpscale's rendezvous handlers tell the workers the round, the attempt number all hosts share."""

import os
import uuid

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from dpscale.comm.attempt import ROUND_ENV
from dpscale.launch import rendezvous


@pytest.fixture
def no_round(monkeypatch):
    monkeypatch.delenv(ROUND_ENV, raising=False)


def _params(backend: str) -> RendezvousParameters:
    return RendezvousParameters(
        backend=backend,
        endpoint=f"{rendezvous.LOOPBACK}:0",
        run_id=f"test-{uuid.uuid4().hex[:8]}",
        min_nodes=1,
        max_nodes=1,
        is_host=True,
        last_call_timeout=1,
    )


def test_each_rendezvous_round_is_exported_to_the_workers(no_round):
    handler = get_rendezvous_handler(_params(rendezvous.register()))
    try:
        handler.next_rendezvous()
        first = os.environ[ROUND_ENV]
        handler.next_rendezvous()  # what the agent does before restarting its workers
        assert int(os.environ[ROUND_ENV]) == int(first) + 1
    finally:
        handler.shutdown()


def test_torchrun_finds_the_multi_host_backend(no_round):
    # registered through the `torchrun.handlers` entry point (pyproject.toml), so plain
    # `torchrun --rdzv-backend dpscale-c10d` uses it
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    params = _params(rendezvous.MULTI_HOST_BACKEND)
    params.config["is_host"] = True
    handler = rendezvous_handler_registry.create_handler(params)
    try:
        handler.next_rendezvous()
        assert os.environ[ROUND_ENV] == "0"
    finally:
        handler.shutdown()
