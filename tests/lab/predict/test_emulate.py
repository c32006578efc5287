"""The emulated multi-host cluster: namespaces torn down always, prediction within 20% of measurement.

Needs root and iproute2 (`ip netns add` must work); skipped with the reason otherwise. The run is
small: 2 hosts x 1 worker on 1 Gbit/s links, a 4 MiB all-reduce and 3 training steps of the mlp.
The training step is checked with every level taken from the emulation's own run (its bare-model
steps, timed beside the training steps, and the link's rate from its all-reduce), so a host whose
load changes between the profile and the emulation, or slows the emulated transfers, does not move
the check (tests/lab/predict/test_emulate_validate.py shows that without a process).
"""

import os
import subprocess

import pytest
from predict_lab import emulate
from predict_lab.emulate_validate import EMULATION_TARGET, validate_emulation

from dpscale.lab.predict.profiling import measure

WHY = emulate.unavailable()
pytestmark = [
    pytest.mark.slow,  # starts processes (spawned ranks in network namespaces)
    pytest.mark.xdist_group("emulated-hosts"),  # one emulated cluster at a time (tests/multihost/conftest.py)
    pytest.mark.skipif(WHY is not None, reason=f"cannot create network namespaces: {WHY}"),
]


def _namespaces() -> set[str]:
    """This process's emulation namespaces (prefix and pid: other jobs on a shared host make their own)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    names = {line.split()[0] for line in out.splitlines() if line.strip()}
    return {n for n in names if n.startswith(f"{emulate.PREFIX}-{os.getpid()}-")}


def test_everything_is_torn_down_even_on_failure():
    config = emulate.EmulationConfig(hosts=3)
    with pytest.raises(RuntimeError, match="boom"):
        with emulate.EmulatedCluster(config) as cluster:
            assert set(cluster.hosts) | {cluster.switch} <= _namespaces()
            out = subprocess.run(
                ["ip", "netns", "exec", cluster.hosts[0], "tc", "qdisc", "show", "dev", "eth0"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            assert "tbf" in out and "rate 1Gbit" in out
            raise RuntimeError("boom")
    assert not (set(cluster.hosts) | {cluster.switch}) & _namespaces()


def test_prediction_matches_a_small_emulated_cluster():
    config = emulate.EmulationConfig(
        hosts=2,
        workers_per_host=1,
        rate_gbit=1.0,
        per_worker_batch=16,
        steps=3,
        warmup=1,
        sizes_bytes=[4 << 20],
    )
    before = _namespaces()
    result = emulate.run(config)
    assert _namespaces() <= before  # nothing left behind
    rows = validate_emulation(result, measure("mlp", 16, steps=5, warmup=1), link_from_run=True)
    assert [r.what.split(" (")[0].split(",")[0] for r in rows] == ["all-reduce 4 MiB", "train step"]
    for r in rows:  # the all-reduce against the tbf rate; the step against the run's own levels
        assert abs(r.error_pct) <= 100 * EMULATION_TARGET, r
