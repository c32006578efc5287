"""An elastic job loses a host for good and goes on with the others (#20; not in the test suite).

Three emulated hosts (tests/multihost's namespaces) run `dpscale train --nnodes 2:3
--max-restarts 1` with a shared checkpoint directory; host 2's link is cut at step ~40. Expected
(docs/fault-tolerance.md): hosts 0 and 1 rejoin without it after torch's last call, resume from
the last checkpoint as 2 workers and finish (exit 0); host 2 exits 1 naming the two hosts it lost.
Prints what happened and exits 1 when that is not it. Needs root (ip netns); ~2 minutes.
Usage: .venv/bin/python scripts/multihost_elastic.py
"""

import json
import socket
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# tests/multihost first: its conftest (the emulated hosts), not tests/conftest
sys.path[:0] = [str(ROOT / "tests" / "multihost"), str(ROOT / "tests")]

from conftest import PREFIX, Hosts, remove_stale  # noqa: E402, I001
from test_partition import _Run  # noqa: E402


def main() -> int:
    remove_stale(PREFIX)
    with tempfile.TemporaryDirectory(prefix="dpscale-elastic-") as ckpt, Hosts(3, prefix=PREFIX) as hosts:
        flags = ["--workload", "digits", "--global-batch", "48", "--max-steps", "300", "--log-every", "20"]
        flags += ["--collective-timeout-s", "10", "--max-restarts", "1", "--json"]
        # the last --nnodes wins: 2:3 over _Run's 3
        flags += ["--checkpoint-dir", ckpt, "--checkpoint-every", "20", "--nnodes", "2:3"]
        run = _Run(hosts, flags)
        run.wait_for("step 40/")
        hosts.link(2, up=False)
        ended = run.wait_ended(300)
        codes = [p.returncode for p in run.procs]
        print(f"seconds from the cut to each host's end: {ended}; exit codes {codes}")
        results = []
        for i in (0, 1):
            out = run.procs[i].stdout.read() if codes[i] == 0 else ""
            results.append(json.loads(out.strip().splitlines()[-1]) if out.strip() else {})
            keys = ("world_size", "steps", "resumed_from_step", "final_loss")
            print(f"host {i}: " + ", ".join(f"{k}={results[i].get(k)}" for k in keys))
        print(f"host 2: {run.errors(2).strip()}")
        went_on = codes[:2] == [0, 0]
        went_on &= all(r.get("steps") == 300 and r.get("world_size") == 2 for r in results)
        name = socket.gethostname()  # the emulated hosts share it
        lost = (
            f"lost hosts {name} ({hosts.addrs[0]}, serves the rendezvous store), {name} ({hosts.addrs[1]}):"
        )
        named = lost in run.errors(2)
        print(f"{time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}, load {open('/proc/loadavg').read()[:14]}")
        return 0 if went_on and codes[2] == 1 and named else 1


if __name__ == "__main__":
    sys.exit(main())
