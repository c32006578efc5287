"""The attempt every host shares, where ranks run, and store calls that cannot block forever."""

import threading
import time

import pytest

from dpscale.comm.attempt import (
    ROUND_ENV,
    attempt_id,
    describe_rank,
    gloo_interface_hint,
    interface_toward,
    is_restart,
    this_host,
    within,
)
from support.timing import cpu_baseline_s


@pytest.fixture
def elastic_env(monkeypatch):
    monkeypatch.delenv(ROUND_ENV, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    return monkeypatch


def test_the_rendezvous_round_names_the_attempt_whatever_this_hosts_restart_count(elastic_env):
    # host A's worker failed (A counts a restart); host B restarted because the group changed and
    # keeps count 0: both joined round 1, so both must use the same keys
    elastic_env.setenv(ROUND_ENV, "1")
    elastic_env.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    on_a = attempt_id()
    elastic_env.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert attempt_id() == on_a == "round_1"
    assert is_restart()  # B resumes from the checkpoint too, though its count is 0


def test_without_the_round_the_restart_count_names_the_attempt(elastic_env):
    assert attempt_id() == "attempt_0" and not is_restart()
    elastic_env.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert attempt_id() == "attempt_2" and is_restart()


def test_a_rank_is_named_with_its_host_when_known():
    assert describe_rank(9, {"host": "node-03", "addr": "10.0.0.7"}) == "rank 9 on host node-03 (10.0.0.7)"
    assert describe_rank(9, None) == "rank 9"
    host = this_host("127.0.0.1")
    assert host["addr"] == "127.0.0.1" and host["host"]  # the address the store's host sees


def test_a_call_that_never_returns_is_abandoned_at_the_deadline():
    release = threading.Event()
    slack_s = 300 * cpu_baseline_s()
    start = time.monotonic()
    assert within(0.3, lambda: release.wait(60), "gave up") == "gave up"
    assert time.monotonic() - start < 0.3 + slack_s
    release.set()
    assert within(5, lambda: 7, None) == 7
    assert within(5, lambda: 1 / 0, "failed") == "failed"  # an error is no answer


def test_the_interface_toward_a_peer_is_found(monkeypatch):
    assert interface_toward("127.0.0.1") == "lo"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert gloo_interface_hint("127.0.0.1") is None  # a store on this host's loopback: nothing to fix
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    assert gloo_interface_hint("192.0.2.1") is None  # the user's choice stands
