"""Network partitions on two emulated hosts running `dpscale train`.

- A link cut for good ends both hosts within the stated time (docs/fault-tolerance.md: the
  collective timeout T, with the rendezvous store's read_timeout defaulting to T, ends the
  store's host within about 2T + 5 s and the cut-off host within 4T + 10 s), each naming the
  host it lost.
- A link down for less than the timeout costs a slow step and nothing else: the run finishes
  with the same parameters as an uninterrupted one.
"""

import json
import subprocess
import sys
import threading
import time
import uuid

import pytest

pytestmark = pytest.mark.slow

TIMEOUT_S = 10  # --collective-timeout-s of the cut test


class _Run:
    """`dpscale train` on every host, each host's stderr read as it comes (for progress and errors)."""

    def __init__(self, hosts, flags: list[str]):
        train = [
            sys.executable,
            "-m",
            "dpscale.cli",
            "train",
            "--nproc",
            "1",
            "--threads",
            "1",
            "--nnodes",
            "2",
        ]
        train += ["--rdzv-endpoint", f"{hosts.addrs[0]}:29400", "--rdzv-id", f"test-{uuid.uuid4().hex[:8]}"]
        self.procs = [hosts.start(i, [*train, *flags, "--local-addr", hosts.addrs[i]]) for i in range(2)]
        self.stderr: list[list[str]] = [[], []]
        self.ended_at: list[float | None] = [None, None]
        for i in range(2):
            threading.Thread(target=self._read, args=(i,), daemon=True).start()

    def _read(self, i: int) -> None:
        for line in self.procs[i].stderr:
            self.stderr[i].append(line)

    def wait_for(self, text: str, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.stderr[0]):
            assert time.monotonic() < deadline, f"no {text!r} on host 0 in {timeout_s} s:\n{self.tail()}"
            assert all(p.poll() is None for p in self.procs), self.tail()
            time.sleep(0.1)

    def wait_ended(self, timeout_s: float) -> list[float | None]:
        """Seconds from now until each host's launcher ended (None: still running at the deadline)."""
        start = time.monotonic()
        ended: list[float | None] = [None, None]
        while None in ended and time.monotonic() - start < timeout_s:
            for i, p in enumerate(self.procs):
                if ended[i] is None and p.poll() is not None:
                    ended[i] = time.monotonic() - start
            time.sleep(0.1)
        return ended

    def tail(self) -> str:
        return "\n".join(f"--- host {i}\n" + "".join(lines[-40:]) for i, lines in enumerate(self.stderr))


def test_a_host_cut_off_for_good_ends_both_hosts_naming_the_lost_host(hosts):
    flags = ["--workload", "digits", "--max-steps", "100000", "--log-every", "20"]
    run = _Run(hosts, [*flags, "--collective-timeout-s", str(TIMEOUT_S)])
    run.wait_for("step 40/")
    hosts.link(1, up=False)  # host 1's cable pulled: it cannot reach host 0, which serves the store
    ended = run.wait_ended(4 * TIMEOUT_S + 10 + 30)  # the stated bound, and slack for a loaded machine
    assert None not in ended, f"still running {ended}:\n{run.tail()}"
    assert [p.returncode for p in run.procs] == [1, 1], run.tail()
    assert ended[0] <= 2 * TIMEOUT_S + 5 + 15 and ended[1] <= 4 * TIMEOUT_S + 10 + 15, ended
    errors = ["".join(line for line in lines if "error:" in line) for lines in run.stderr]
    # each host names the other: the store's host a silent rank on host 1, host 1 the store it lost
    assert hosts.addrs[1] in "".join(run.stderr[0]), run.tail()
    assert f"lost the rendezvous store at {hosts.addrs[0]}:29400" in errors[1], run.tail()


def _params(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_a_short_outage_costs_a_slow_step_and_nothing_else(hosts):
    flags = ["--workload", "digits", "--global-batch", "32", "--max-steps", "600", "--log-every", "20"]
    flags += ["--progress", "plain", "--json", "--collective-timeout-s", "60"]
    reference = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + ["-m", "dpscale.train.worker", *flags],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    run = _Run(hosts, flags)
    run.wait_for("step 40/")
    hosts.link(1, up=False)
    time.sleep(3)  # well under the 60 s collective timeout and the store's read timeout
    hosts.link(1, up=True)
    assert all(p.poll() is None for p in run.procs), run.tail()  # the outage came mid-training
    outs = [p.communicate(timeout=600)[0] for p in run.procs]
    assert [p.returncode for p in run.procs] == [0, 0], run.tail()
    expected = _params(reference.stdout)
    for out in outs:  # every host's launcher prints the job's result
        result = _params(out)
        for key in ("steps", "samples_seen", "final_loss", "param_sha256"):
            assert result[key] == expected[key], key
