"""Who can reach a two-host `dpscale train`: inside each emulated host, `ss -ltn` shows the job's
listening sockets on that host's own address only, never on every interface (`*`, 0.0.0.0, ::).

The namespaces are fresh, so every listener in them belongs to the job: the rendezvous store on
the endpoint's host, the agent store on the host that is the group's rank 0, and gloo's sockets.
"""

import subprocess
import sys
import time
import uuid

import pytest

pytestmark = pytest.mark.slow


def _listening(ns: str) -> list[str]:
    ss = ["ip", "netns", "exec", ns, "ss", "-Hltn"]
    out = subprocess.run(ss, capture_output=True, text=True, check=True, timeout=30)
    return [line.split()[3] for line in out.stdout.splitlines() if line.strip()]


def test_each_host_listens_on_its_named_address_only(hosts):
    endpoint = f"{hosts.addrs[0]}:29400"
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
    train += ["--rdzv-endpoint", endpoint, "--rdzv-id", f"test-{uuid.uuid4().hex[:8]}"]
    train += ["--workload", "digits", "--max-steps", "100000", "--progress", "none"]
    procs = [hosts.start(i, [*train, "--local-addr", hosts.addrs[i]]) for i in range(2)]
    # training has started once both gloo ranks listen besides the two stores (4 sockets in all)
    deadline = time.monotonic() + 120
    while True:
        found = [_listening(ns) for ns in hosts.names]
        if sum(map(len, found)) >= 4 or time.monotonic() > deadline:
            break
        assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs]
        time.sleep(0.5)
    assert sum(map(len, found)) >= 4, found
    assert endpoint in found[0], found  # the rendezvous store, on the endpoint's address
    for addr, ports in zip(hosts.addrs, found, strict=True):
        assert all(p.rpartition(":")[0] == addr for p in ports), (addr, found)
