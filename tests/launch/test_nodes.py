"""`dpscale train`'s multi-host flags: parsing, refusals, and which host serves the store."""

import subprocess
import sys

import pytest

from dpscale.launch.nodes import REJOIN_MARGIN_S, Nodes, carries_address, parse_nnodes, parse_rdzv_conf


def _nodes(**kw) -> Nodes:
    return Nodes(**{"min_nodes": 1, "max_nodes": 2, "rdzv_endpoint": "127.0.0.1:29400", "rdzv_id": "j", **kw})


def test_flags_parse_as_torchrun_reads_them():
    assert parse_nnodes("2") == (2, 2) and parse_nnodes("1:3") == (1, 3)
    assert parse_rdzv_conf("is_host=1, join_timeout=60") == {"is_host": "1", "join_timeout": "60"}
    assert parse_rdzv_conf(None) == {}


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: parse_nnodes("3:2"), "--nnodes must be N or MIN:MAX"),
        (lambda: parse_rdzv_conf("is_host"), "--rdzv-conf takes key=value"),
        (lambda: _nodes(rdzv_endpoint="10.0.0.1"), "--rdzv-endpoint must be HOST:PORT"),
        (lambda: _nodes(rdzv_id=""), "--rdzv-id must name the job"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_the_host_carrying_the_endpoint_address_serves_the_store():
    assert carries_address("127.0.0.1")
    assert not carries_address("192.0.2.1")  # TEST-NET-1: on no interface of this machine
    assert _nodes().rdzv_configs()["is_host"] is True
    assert _nodes(rdzv_endpoint="192.0.2.1:29400").serves_store() is False
    assert _nodes(rdzv_conf={"is_host": "0", "join_timeout": "9"}).rdzv_configs(12.5) == {
        "is_host": False,
        "join_timeout": "9",
        "read_timeout": 13,
    }


def test_a_store_call_waits_the_collective_timeout_unless_read_timeout_is_given():
    # torch's 60 s per call kept a cut-off host's agent waiting minutes after its workers gave up
    assert _nodes().read_timeout_s(10) == 10
    assert _nodes(rdzv_conf={"read_timeout": "30"}).read_timeout_s(10) == 30
    with pytest.raises(ValueError, match="read_timeout"):
        _nodes(rdzv_conf={"read_timeout": "0"})


def test_a_rejoin_after_a_failure_waits_the_collective_timeout_plus_a_margin():
    # torch's join_timeout (600 s) kept the store's host waiting that long for a host cut off for
    # good; the first round keeps it (hosts started by hand), a rejoin waits T + margin
    fixed = _nodes(min_nodes=2)
    assert fixed.rdzv_configs(10)["rejoin_timeout"] == 10 + REJOIN_MARGIN_S
    # MIN:MAX: once MIN hosts are back, torch waits last_call_timeout (30 s) for more, then goes on
    assert _nodes().rejoin_timeout_s(10) == 10 + REJOIN_MARGIN_S + 30
    assert _nodes(rdzv_conf={"last_call_timeout": "5"}).rejoin_timeout_s(10) == 10 + REJOIN_MARGIN_S + 5
    # the user's value wins: an explicit join_timeout applies to every round, as in torch
    assert "rejoin_timeout" not in _nodes(rdzv_conf={"join_timeout": "900"}).rdzv_configs(10)
    assert _nodes(rdzv_conf={"rejoin_timeout": "45"}).rdzv_configs(10)["rejoin_timeout"] == 45
    with pytest.raises(ValueError, match="--rdzv-conf join_timeout must be a whole number"):
        _nodes(rdzv_conf={"join_timeout": "soon"})


@pytest.mark.slow
def test_the_cli_refuses_half_a_multi_host_command():
    p = subprocess.run(
        [sys.executable, "-m", "dpscale.cli.main", "train", "--nnodes", "2", "--max-steps", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    assert "--nnodes needs --rdzv-endpoint HOST:PORT and --rdzv-id NAME" in p.stderr


def test_node_rank_means_a_static_rendezvous_of_a_fixed_number_of_hosts():
    first, second = _nodes(min_nodes=2, node_rank=0), _nodes(min_nodes=2, node_rank=1)
    # the host of rank 0 serves the store (and holds the checkpoint-directory lock), whatever its addresses
    assert first.serves_store() and not second.serves_store()
    assert second.rdzv_configs(10) == {"rank": 1}
    with pytest.raises(ValueError, match="--node-rank must be 0..1 for --nnodes 2, got 2"):
        _nodes(min_nodes=2, node_rank=2)
    with pytest.raises(ValueError, match="fixed number of hosts.*give --nnodes N"):
        _nodes(node_rank=0)  # --nnodes 1:2


def test_node_rank_with_restarts_is_refused_before_anything_starts():
    from dpscale.launch.launcher import launch
    from dpscale.train.config import TrainConfig

    cfg = TrainConfig(workload="digits", max_steps=1)
    with pytest.raises(ValueError, match="--node-rank .* cannot restart across hosts"):
        launch(cfg, 1, max_restarts=1, nodes=_nodes(min_nodes=2, node_rank=0))
