"""`dpscale run` when the user's script misbehaves across ranks (#34).

One rank leaving mid-script: the others' next collective waits as long as the script told
`init_process_group` (torch's engine honours it), not the 300 s of dpscale's engine default.
"""

import pytest

from support.cli_runs import run_cli
from support.timing import process_baseline_once_s

pytestmark = pytest.mark.slow  # starts the CLI and its workers

SCRIPT = """
import datetime, sys
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
model = DDP(nn.Linear(4, 2))
model(torch.ones(2, 4)).sum().backward()
print(f"rank {dist.get_rank()} synced once", flush=True)
if dist.get_rank() == 1:
    sys.exit(0)  # leaves mid-script: rank 0's next all-reduce has no peer
model(torch.ones(2, 4)).sum().backward()
print("rank 0 went on without its peer", flush=True)
"""


def test_a_rank_that_leaves_times_out_its_peer_after_the_scripts_own_timeout(tmp_path):
    script = tmp_path / "leaves.py"
    # the script's timeout bounds its rendezvous too: it must cover the two workers' start-up skew
    # (a part of one start), so it is a start measured now, and the test waits it out once
    timeout_s = max(3, round(1.5 * process_baseline_once_s()))
    script.write_text(SCRIPT.replace("TIMEOUT_S", str(timeout_s)))
    # the script's timeout and the start of two workers fit well inside this; dpscale's own 300 s do not
    p = run_cli(["run", "--nproc", "2", str(script)], timeout_s=150)
    assert p.returncode != 0, p.stdout + p.stderr
    # it was the all-reduce after the peer left that timed out, not the rendezvous or the first one
    assert "rank 0 synced once" in p.stdout, p.stdout + p.stderr
    assert "went on without its peer" not in p.stdout
