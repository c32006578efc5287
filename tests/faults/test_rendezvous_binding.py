"""Who can reach a single-host job: every port its processes listen on is bound to 127.0.0.1.

Before, the agent's two rendezvous stores listened on every interface (`ss -ltnp` showed `*:PORT`
twice), unauthenticated: anyone on the network could join or disrupt the job.
"""

import pytest

from support.cli_runs import TRAIN_NO_CHECKPOINTS, StderrWatch, kill_tagged, start_cli, tagged
from support.sockets import listening

# slow: starts processes (spawned ranks or the CLI); compat: also run on a second torch release
pytestmark = [pytest.mark.slow, pytest.mark.compat]


def test_a_single_host_job_listens_on_loopback_only():
    run = [a if a != "30" else "100000" for a in TRAIN_NO_CHECKPOINTS] + ["--log-every", "5"]
    proc, tag = start_cli(run)
    try:
        StderrWatch(proc).wait_for("step 5/")
        ports = listening(tagged(tag))
        # the rendezvous store and the agent store (launcher), gloo's sockets (workers)
        assert len(ports) >= 2, ports
        assert all(p.startswith("127.0.0.1:") for p in ports), ports
    finally:
        kill_tagged(tag)
        proc.wait()
