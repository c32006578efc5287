"""A refusal on one rank reaches the others through the store (launch/refusal_watch.py).

The watch's thread (which ends the process) is not started here: the test calls what it calls.
"""

import json

import pytest
import torch.distributed as dist

from dpscale.errors import ConfigError, UserCodeError
from dpscale.launch import refusal_watch
from dpscale.launch.protocol import refusals
from dpscale.launch.refusal_watch import PeerRefused, RefusalWatch


@pytest.fixture(autouse=True)
def no_linger(monkeypatch):
    monkeypatch.setattr(refusal_watch, "LINGER_S", 0.0)


def test_a_rank_refused_by_its_input_tells_the_others_and_keeps_its_error(tmp_path):
    store = dist.HashStore()
    with pytest.raises(ConfigError, match="bad checkpoint"):
        with RefusalWatch(store, 1, str(tmp_path)):
            raise ConfigError("bad checkpoint for rank 1\nmore")
    other = RefusalWatch(store, 0, str(tmp_path))
    assert other.peer_refusal() == {"rank": 1, "bad_input": "bad checkpoint for rank 1", "user_traceback": ""}
    # the refusing rank does not take its own announcement for a peer's
    assert RefusalWatch(store, 1, str(tmp_path)).peer_refusal() is None


def test_a_collective_broken_by_a_peer_that_was_refused_is_that_refusal(tmp_path):
    store = dist.HashStore()
    store.set(refusal_watch.KEY, json.dumps({"rank": 1, "bad_input": "bad input", "user_traceback": "tb"}))
    watch = RefusalWatch(store, 0, str(tmp_path))  # not entered: its thread would end this process
    with pytest.raises(PeerRefused) as refused:
        watch.__exit__(RuntimeError, RuntimeError("Connection closed by peer"), None)
    assert str(refused.value) == "bad input" and refused.value.user_traceback == "tb"
    assert isinstance(refused.value, UserCodeError)  # the worker writes it as its own refusal


def test_without_a_refusal_a_failure_stays_a_failure(tmp_path):
    watch = RefusalWatch(dist.HashStore(), 0, str(tmp_path))
    assert watch.__exit__(RuntimeError, RuntimeError("boom"), None) is None
    assert refusals(tmp_path) == []


def test_sys_exit_in_the_users_code_is_announced_as_a_refusal(tmp_path):
    store = dist.HashStore()
    with pytest.raises(SystemExit):
        with RefusalWatch(store, 1, str(tmp_path)):
            raise SystemExit(0)
    assert (
        RefusalWatch(store, 0, str(tmp_path)).peer_refusal()["bad_input"].startswith(refusal_watch.USER_EXIT)
    )


def test_a_failure_does_not_wait_on_a_store_that_stopped_answering(tmp_path, monkeypatch):
    store = dist.HashStore()
    store.set(refusal_watch.KEY, json.dumps({"rank": 1, "bad_input": "bad input", "user_traceback": ""}))
    watch = RefusalWatch(store, 0, str(tmp_path))
    watch._last_answer -= 60  # the watch's last answer from the store: a minute ago (a cut link)
    assert watch.__exit__(RuntimeError, RuntimeError("timed out"), None) is None
