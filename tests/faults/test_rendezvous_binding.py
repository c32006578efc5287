"""Who can reach a single-host job: every port its processes listen on is bound to 127.0.0.1.

Before, the agent's two rendezvous stores listened on every interface (`ss -ltnp` showed `*:PORT`
twice), unauthenticated: anyone on the network could join or disrupt the job; `dpscale run` and
`scale` (torchrun --standalone) did so until #34.
"""

import os
import time

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


WAITING_SCRIPT = """
import datetime, os, time
import torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
open(os.path.join(os.environ["READY_DIR"], str(dist.get_rank())), "w").close()
time.sleep(120)
"""


@pytest.mark.parametrize(
    "command",
    [["run", "--nproc", "2"], ["scale", "--nproc", "2", "--steps", "5", "--warmup", "1", "--"]],
    ids=["run", "scale"],
)
def test_run_and_scale_listen_on_loopback_only(tmp_path, command):
    script, ready = tmp_path / "wait.py", tmp_path / "ready"
    script.write_text(WAITING_SCRIPT)
    ready.mkdir()
    proc, tag = start_cli([*command, str(script)], env=dict(os.environ, READY_DIR=str(ready)), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while len(list(ready.iterdir())) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        ports = listening(tagged(tag))
        # the rendezvous store and the agent store (the agent), gloo's sockets (workers)
        assert len(ports) >= 2, ports
        assert all(p.startswith("127.0.0.1:") for p in ports), ports
    finally:
        kill_tagged(tag)
        proc.wait()
