"""`dpscale.launch.worker` on two emulated hosts (torchrun on each) equals the one-host run.

`dpscale train --nnodes 2` (no --rdzv-conf: the host whose interface carries the endpoint's
address serves the store) equal to the one-host run is checked by
test_partition.py::test_a_short_outage_costs_a_slow_step_and_nothing_else, which runs it with a
short outage in the middle (one multi-host run fewer in the suite).
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.torchrun import torchrun

pytestmark = pytest.mark.slow

WORKER = ["-m", "dpscale.launch.worker", "--workload", "digits", "--global-batch", "32", "--max-steps", "4"]
WORKER += ["--progress", "none", "--json"]
# The kill-and-recover test (one-host reference run included) took 62 s on a quiet 2-core host and
# 204 s at load 11 with two busy loops beside it (scripts/multihost_restarts.sh); the bounds are
# about 6 and 10 times the quiet figure, so that a loaded host is slow, not failed, while a hang
# still ends the test.
HOSTS_WAIT_S = 360
TEST_TIMEOUT_S = 600  # pytest-timeout: the one-host reference and one two-host run
LOG_DIR_ENV = "DPSCALE_MULTIHOST_LOG_DIR"
"""Where each test keeps both hosts' output (a folder per test); unset: the test's tmp_path."""
TRIES_ENV = "DPSCALE_RESTART_TRIES"


@dataclass
class HostOutput:
    host: int
    returncode: int | None
    """None: killed after the deadline"""
    stdout: str
    stderr: str
    seconds: float


def _wait(procs: list[subprocess.Popen], timeout_s: float) -> list[HostOutput]:
    """Every host's output, all waited for at once under one deadline; a host still running then
    is killed with its process group (its workers hold the pipes open) and returns None."""
    outputs: list[HostOutput | None] = [None] * len(procs)
    start = time.monotonic()

    def wait(i: int, proc: subprocess.Popen) -> None:
        try:
            out, err = proc.communicate(timeout=timeout_s)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = proc.communicate()
            code = None
        outputs[i] = HostOutput(i, code, out, err, time.monotonic() - start)

    threads = [threading.Thread(target=wait, args=(i, p)) for i, p in enumerate(procs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(o is not None for o in outputs)
    return [o for o in outputs if o is not None]


def _keep(outputs: list[HostOutput], logs: Path) -> None:
    """Both hosts' whole output under `logs` (host0.stdout, host0.stderr, ...), kept after the test."""
    logs.mkdir(parents=True, exist_ok=True)
    for o in outputs:
        (logs / f"host{o.host}.stdout").write_text(o.stdout)
        (logs / f"host{o.host}.stderr").write_text(o.stderr)
    summary = {f"host{o.host}": {"returncode": o.returncode, "seconds": round(o.seconds, 1)} for o in outputs}
    (logs / "summary.json").write_text(json.dumps(summary, indent=1))


def _failed(outputs: list[HostOutput], logs: Path, what: str) -> None:
    tails = [
        f"--- host {o.host}: "
        + (f"exit {o.returncode}" if o.returncode is not None else "killed, still running")
        + f" after {o.seconds:.0f} s; stderr tail:\n{o.stderr[-2500:]}"
        for o in outputs
    ]
    pytest.fail(f"{what}; both hosts' logs in {logs}\n" + "\n".join(tails))


@pytest.fixture
def host_logs(request, tmp_path) -> Path:
    """Where this test keeps both hosts' output ($DPSCALE_MULTIHOST_LOG_DIR/<test> when set)."""
    base = os.environ.get(LOG_DIR_ENV)
    name = request.node.name.replace("/", "_").replace("[", "-").replace("]", "")
    return Path(base) / name if base else tmp_path / "hosts"


def _one_host(extra: list[str], log_dir: Path) -> dict:
    one_host = subprocess.run(
        torchrun(log_dir, "--standalone", "--nproc-per-node", "2", *WORKER, *extra),
        capture_output=True,
        text=True,
        timeout=HOSTS_WAIT_S,
    )
    assert one_host.returncode == 0, one_host.stderr[-3000:]
    return json.loads(one_host.stdout.strip().splitlines()[-1])


def _two_hosts(
    hosts, extra_torchrun: list[str], extra_worker: list[str], logs: Path, env1: dict | None = None
) -> dict:
    """rank 0's result; both hosts' output is kept in `logs`, and a failure says where."""
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
    command = torchrun(logs / "torchrun", *rdzv, *extra_torchrun)
    # host 0 holds the store: the host name does not resolve to the link's address in a namespace,
    # so torchrun's own guess would say no
    first = hosts.start(
        0, [*command, "--rdzv-conf", "is_host=1", "--local-addr", hosts.addrs[0], *WORKER, *extra_worker]
    )
    second = hosts.start(
        1,
        [*command, "--rdzv-conf", "is_host=0", "--local-addr", hosts.addrs[1], *WORKER, *extra_worker],
        env=hosts.env(1, **(env1 or {})),
    )
    outputs = _wait([first, second], HOSTS_WAIT_S)
    _keep(outputs, logs)
    if any(o.returncode != 0 for o in outputs):
        _failed(outputs, logs, "a host failed")
    lines = [o.stdout.strip().splitlines() for o in outputs]
    results = [json.loads(out[-1]) for out in lines if out]
    if len(results) != 1:  # only rank 0 prints
        _failed(outputs, logs, f"{len(results)} hosts printed a result, expected 1 (rank 0's)")
    return results[0]


def _same(result: dict, reference: dict, keys: tuple[str, ...], logs: Path) -> None:
    differ = {k: (result.get(k), reference.get(k)) for k in keys if result.get(k) != reference.get(k)}
    assert not differ, f"differs from the one-host run (two hosts, one host): {differ}; logs in {logs}"


KEYS = ("steps", "samples_seen", "final_loss", "test_accuracy", "param_sha256")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The one-host run without extra flags: two tests compare with it, and it is the same run."""
    return _one_host([], tmp_path_factory.mktemp("torchrun"))


@pytest.fixture(scope="module")
def checkpointed_reference(tmp_path_factory) -> dict:
    """The one-host run saving a checkpoint every step, what a recovered run must equal (once
    per module: the repeated kill-and-recover tries compare with the same run)."""
    where = tmp_path_factory.mktemp("one-host")
    return _one_host(["--checkpoint-dir", str(where / "ck"), "--checkpoint-every", "1"], where / "torchrun")


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_two_hosts_train_as_one_host_does(hosts, reference, host_logs):
    multi = _two_hosts(hosts, [], [], host_logs)
    assert multi["world_size"] == reference["world_size"] == 2
    # two workers: one addition per element, the same in either order, so bit-exact
    _same(multi, reference, KEYS, host_logs)


def _kill_and_recover(hosts, reference: dict, tmp_path: Path, logs: Path) -> None:
    # The killed worker's host counts a restart; the other host restarts only because the group
    # changed and keeps count 0. Both must meet under the same keys (the rendezvous round) and both
    # must resume from the checkpoint.
    recovered = _two_hosts(
        hosts,
        ["--max-restarts", "1"],
        ["--checkpoint-dir", str(tmp_path / "two"), "--checkpoint-every", "1"],
        logs,
        # the fault reaches host 1's trainers through a callback its workers build
        env1={
            "DPSCALE_FAULTS": "kill@step=3,rank=1,attempt=0",
            "DPSCALE_CALLBACKS": "dpscale.testing.faults:FaultInjector",
        },
    )
    assert recovered["resumed_from_step"] == 2, f"logs in {logs}"
    _same(recovered, reference, KEYS, logs)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_killed_worker_on_one_host_recovers_bit_exactly(hosts, checkpointed_reference, tmp_path, host_logs):
    _kill_and_recover(hosts, checkpointed_reference, tmp_path, host_logs)


@pytest.mark.stress
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("attempt", range(1, int(os.environ.get(TRIES_ENV, "0")) + 1))
def test_a_killed_worker_on_one_host_recovers_every_time(
    hosts, checkpointed_reference, tmp_path, host_logs, attempt
):
    """The same, $DPSCALE_RESTART_TRIES times (unset: not at all, so `make test` leaves it out), each
    on fresh hosts: scripts/multihost_restarts.sh runs it 20 times (under load with LOAD=N) and
    keeps every failed try's logs."""
    _kill_and_recover(hosts, checkpointed_reference, tmp_path, host_logs)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_static_rendezvous_with_node_rank_trains_as_one_host_does(hosts, reference, host_logs):
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
    outputs = _wait(procs, HOSTS_WAIT_S)
    _keep(outputs, host_logs)
    if any(o.returncode != 0 for o in outputs):
        _failed(outputs, host_logs, "a host failed")
    for o in outputs:  # under dpscale train every host prints the job's result
        _same(json.loads(o.stdout.strip().splitlines()[-1]), reference, ("world_size", *KEYS), host_logs)
