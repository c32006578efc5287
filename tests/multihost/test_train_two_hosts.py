"""`dpscale.launch.worker` on two emulated hosts (torchrun on each) equals the one-host run.

`dpscale train --nnodes 2` (no --rdzv-conf: the host whose interface carries the endpoint's
address serves the store) equal to the one-host run is checked by
test_partition.py::test_a_short_outage_costs_a_slow_step_and_nothing_else, which runs it with a
short outage in the middle (one multi-host run fewer in the suite).
"""

import json
import subprocess
import sys
import uuid

import pytest

pytestmark = pytest.mark.slow

WORKER = ["-m", "dpscale.launch.worker", "--workload", "digits", "--global-batch", "32", "--max-steps", "4"]
WORKER += ["--progress", "none", "--json"]


def _result(proc: subprocess.Popen, timeout_s: float) -> dict | None:
    """The JSON line rank 0 prints; None from a host without rank 0."""
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err[-3000:]
    lines = out.strip().splitlines()
    return json.loads(lines[-1]) if lines else None


def _one_host(extra: list[str]) -> dict:
    one_host = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            *WORKER,
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one_host.returncode == 0, one_host.stderr[-3000:]
    return json.loads(one_host.stdout.strip().splitlines()[-1])


def _two_hosts(hosts, extra_torchrun: list[str], extra_worker: list[str], env1: dict | None = None) -> dict:
    rdzv = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "dpscale-c10d",
        "--rdzv-endpoint",
        f"{hosts.addrs[0]}:29400",
        "--rdzv-id",
        f"test-{uuid.uuid4().hex[:8]}",
    ]
    torchrun = [sys.executable, "-m", "torch.distributed.run", *rdzv]
    # host 0 holds the store: the host name does not resolve to the link's address in a namespace,
    # so torchrun's own guess would say no
    torchrun += extra_torchrun
    first = hosts.start(
        0, [*torchrun, "--rdzv-conf", "is_host=1", "--local-addr", hosts.addrs[0], *WORKER, *extra_worker]
    )
    second = hosts.start(
        1,
        [*torchrun, "--rdzv-conf", "is_host=0", "--local-addr", hosts.addrs[1], *WORKER, *extra_worker],
        env=hosts.env(1, **(env1 or {})),
    )
    results = [_result(p, 300) for p in (first, second)]
    assert sum(r is not None for r in results) == 1  # only rank 0 prints
    return next(r for r in results if r)


@pytest.fixture(scope="module")
def reference() -> dict:
    """The one-host run without extra flags: two tests compare with it, and it is the same run."""
    return _one_host([])


def test_two_hosts_train_as_one_host_does(hosts, reference):
    multi = _two_hosts(hosts, [], [])
    assert multi["world_size"] == reference["world_size"] == 2
    # two workers: one addition per element, the same in either order, so bit-exact
    for key in ("steps", "samples_seen", "final_loss", "test_accuracy", "param_sha256"):
        assert multi[key] == reference[key], key


def test_a_killed_worker_on_one_host_recovers_bit_exactly(hosts, tmp_path):
    # The killed worker's host counts a restart; the other host restarts only because the group
    # changed and keeps count 0. Both must meet under the same keys (the rendezvous round) and both
    # must resume from the checkpoint.
    reference = _one_host(["--checkpoint-dir", str(tmp_path / "one"), "--checkpoint-every", "1"])
    recovered = _two_hosts(
        hosts,
        ["--max-restarts", "1"],
        ["--checkpoint-dir", str(tmp_path / "two"), "--checkpoint-every", "1"],
        # the fault reaches host 1's trainers through a callback its workers build
        env1={
            "DPSCALE_FAULTS": "kill@step=3,rank=1,attempt=0",
            "DPSCALE_CALLBACKS": "dpscale.testing.faults:FaultInjector",
        },
    )
    assert recovered["resumed_from_step"] == 2
    for key in ("steps", "samples_seen", "final_loss", "test_accuracy", "param_sha256"):
        assert recovered[key] == reference[key], key


def test_static_rendezvous_with_node_rank_trains_as_one_host_does(hosts, reference):
    # torchrun's --node-rank: each host is told its rank; host 0 serves the store at the endpoint
    train = [
        sys.executable,
        "-m",
        "dpscale.cli.main",
        "train",
        "--nproc",
        "1",
        "--threads",
        "1",
        "--nnodes",
        "2",
    ]
    train += ["--rdzv-endpoint", f"{hosts.addrs[0]}:29400", "--rdzv-id", f"test-{uuid.uuid4().hex[:8]}"]
    train += WORKER[2:]
    argv = [[*train, "--node-rank", str(i), "--local-addr", addr] for i, addr in enumerate(hosts.addrs)]
    procs = [hosts.start(i, a) for i, a in enumerate(argv)]
    results = [_result(p, 300) for p in procs]
    for result in results:
        for key in ("world_size", "steps", "samples_seen", "final_loss", "test_accuracy", "param_sha256"):
            assert result[key] == reference[key], key
