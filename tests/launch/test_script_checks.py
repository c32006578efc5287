"""The script checks of `dpscale run`/`scale` (launch/script_checks.py) from a rank's facts, and the
engine's unused-parameter error as a record (the runs themselves: tests/launch/test_run_scale.py)."""

import pickle
from dataclasses import asdict

import pytest
import torch
from torch import nn

from dpscale.engine.reducer import UnusedParametersError
from dpscale.launch import script_checks
from dpscale.launch.script_checks import ScriptFacts, findings, per_rank_batch_norms


def _facts(**kw) -> dict:
    doc = asdict(ScriptFacts(**{"world_size": 2, **kw}))
    doc.pop("_since_step")
    return doc


def test_accumulation_without_no_sync_is_said_with_the_fix():
    (line,) = findings([_facts(synced_forwards=40, optimizer_steps=10, synced_per_step=[4] * 10)])
    assert line.startswith("all-reduce on every micro-step: 4 synced backwards per optimizer step")
    assert "model.no_sync()" in line


@pytest.mark.parametrize(
    "facts",
    [
        _facts(unsynced_forwards=30, synced_per_step=[1] * 10),  # no_sync on 3 of 4
        _facts(unsynced_forwards=20, synced_per_step=[2] * 10),  # the toggle, half the time
        _facts(synced_per_step=[1] * 10),  # no accumulation
        _facts(world_size=1, synced_per_step=[4] * 10),  # one worker reduces nothing
    ],
)
def test_no_accumulation_finding_where_the_script_skips_syncs_or_does_not_accumulate(facts):
    assert findings([facts]) == []


def test_batch_norm_layers_that_train_per_rank_are_named():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2), nn.BatchNorm1d(2))
    model[3].eval()  # frozen statistics: the same on every rank
    assert per_rank_batch_norms(model) == ["1"]
    assert per_rank_batch_norms(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))) == []
    assert per_rank_batch_norms(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))) == ["1"]
    assert per_rank_batch_norms(nn.SyncBatchNorm(4)) == []
    (line,) = findings([_facts(batch_norm=["1"])])
    assert "BatchNorm without SyncBatchNorm (1)" in line and "convert_sync_batchnorm" in line
    assert "not equivalent" in line


def test_synced_forwards_are_counted_per_optimizer_step():
    facts = ScriptFacts(world_size=2)
    for _ in range(3):
        for _ in range(4):
            facts.on_training_forward(nn.Linear(1, 1), synced=True)
        facts.on_optimizer_step(torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1))
    facts.on_training_forward(nn.Linear(1, 1), synced=True)  # the forward the step limit stops at
    assert facts.synced_per_step == [4, 4, 4] and facts.synced_forwards == 13


def test_the_first_training_forward_at_one_worker_checks_no_batch_norm():
    facts = ScriptFacts(world_size=1)
    facts.on_training_forward(nn.BatchNorm1d(3), synced=True)
    assert facts.batch_norm == []


def test_unused_parameters_become_advice():
    (line,) = findings([_facts(), _facts(rank=1, unused=["head.weight", "head.bias"])])
    assert "'head.weight'" not in line and "head.weight, head.bias" in line
    assert "find_unused_parameters=True" in line and "requires_grad=False" in line


def test_the_engines_unused_parameter_error_carries_the_names_and_pickles():
    e = UnusedParametersError(["a.weight", "b.bias"])
    assert isinstance(e, RuntimeError) and "'a.weight', 'b.bias'" in str(e)
    assert pickle.loads(pickle.dumps(e)).names == ["a.weight", "b.bias"]


def test_each_optimizer_step_records_its_learning_rate():
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.05)
    facts = ScriptFacts()
    for _ in range(script_checks.MAX_LRS + 3):
        facts.on_optimizer_step(opt)
    assert facts.optimizer_steps == script_checks.MAX_LRS + 3
    assert facts.lrs == [0.05] * script_checks.MAX_LRS


def test_facts_round_trip_through_the_directory(tmp_path):
    ScriptFacts(rank=1, world_size=2, synced_forwards=3).write(tmp_path)
    ScriptFacts(rank=0, world_size=2).write(tmp_path)
    assert [d["rank"] for d in script_checks.read_facts(tmp_path)] == [0, 1]


@pytest.fixture
def two_hosts(monkeypatch):
    """This host reaches the store (10.0.0.1) through eth0 (10.0.0.2); its name resolves to 10.0.0.2."""
    monkeypatch.setattr(script_checks, "interface_toward", lambda addr: "eth0")
    monkeypatch.setattr(script_checks, "source_address", lambda addr: "10.0.0.2")
    names = {"10.0.0.1": "10.0.0.1", "127.0.0.1": "127.0.0.1"}
    monkeypatch.setattr(script_checks.socket, "gethostbyname", lambda name: names.get(name, "10.0.0.2"))
    return {"MASTER_ADDR": "10.0.0.1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}


def test_gloo_on_loopback_across_hosts_is_said_with_the_interface_to_use(two_hosts):
    line = script_checks.interface_problem("gloo", {**two_hosts, "GLOO_SOCKET_IFNAME": "lo"})
    assert line is not None and "gloo would use lo" in line and "GLOO_SOCKET_IFNAME=eth0" in line
    assert script_checks.interface_problem("gloo", {**two_hosts, "GLOO_SOCKET_IFNAME": "eth0"}) is None
    assert script_checks.interface_problem("gloo", two_hosts) is None  # the host name resolves right


def test_gloo_bound_by_the_host_name_to_another_network_is_said(two_hosts, monkeypatch):
    monkeypatch.setattr(
        script_checks.socket, "gethostbyname", lambda name: name if name == "10.0.0.1" else "172.17.0.1"
    )
    line = script_checks.interface_problem("gloo", two_hosts)
    assert line is not None and "172.17.0.1" in line and "through eth0 (10.0.0.2)" in line


def test_nccl_told_to_use_loopback_or_another_interface_across_hosts_is_said(two_hosts):
    line = script_checks.interface_problem("nccl", {**two_hosts, "NCCL_SOCKET_IFNAME": "lo"})
    assert line is not None and "NCCL_SOCKET_IFNAME=eth0" in line
    assert script_checks.interface_problem("nccl", {**two_hosts, "NCCL_SOCKET_IFNAME": "eth"}) is None
    assert script_checks.interface_problem("nccl", two_hosts) is None  # NCCL leaves out lo itself


def test_one_host_or_a_store_on_loopback_is_never_an_interface_problem(two_hosts):
    env = {**two_hosts, "GLOO_SOCKET_IFNAME": "lo"}
    assert script_checks.interface_problem("gloo", {**env, "LOCAL_WORLD_SIZE": "4"}) is None
    assert script_checks.interface_problem("gloo", {**env, "MASTER_ADDR": "127.0.0.1"}) is None
