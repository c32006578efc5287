"""`dpscale run` when the user's script misbehaves across ranks (#34).

One rank leaving mid-script: the others' next collective waits as long as the script told
`init_process_group` (torch's engine honours it), not the 300 s of dpscale's engine default.
"""

import pytest

from support.cli_runs import run_cli

pytestmark = pytest.mark.slow  # starts the CLI and its workers

SCRIPT = """
import datetime, sys
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
model = DDP(nn.Linear(4, 2))
model(torch.ones(2, 4)).sum().backward()
if dist.get_rank() == 1:
    sys.exit(0)  # leaves mid-script: rank 0's next all-reduce has no peer
model(torch.ones(2, 4)).sum().backward()
print("rank 0 went on without its peer", flush=True)
"""


def test_a_rank_that_leaves_times_out_its_peer_after_the_scripts_own_timeout(tmp_path):
    script = tmp_path / "leaves.py"
    script.write_text(SCRIPT)
    # the script's 10 s and the start of two workers fit well inside this; dpscale's own 300 s do not
    p = run_cli(["run", "--nproc", "2", str(script)], timeout_s=150)
    assert p.returncode != 0, p.stdout + p.stderr
    assert "went on without its peer" not in p.stdout
