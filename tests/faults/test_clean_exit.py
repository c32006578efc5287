"""#14 item 11: a 2-rank process that built several dpscale engines next to torch's DDP and called
`destroy_process_group` once ended with SIGABRT (about 1 in 30 runs). The cause was torch's
(a gloo thread kept alive by `torch._dynamo` needs the GIL during interpreter shutdown); dpscale's
part is to leave nothing running behind the process group: no thread of its own survives it.
The worker and the CLI also leave through `exit_now` (tests/launch/test_process_life.py).
"""

import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dpscale import DistributedDataParallel
from dpscale.lab.multirank import run_ranks

pytestmark = pytest.mark.slow  # starts processes (spawned ranks)


def engines_then_destroy(rank, world):
    models = [DistributedDataParallel(nn.Linear(8, 4), transport=t) for t in ("gloo", "shm", "auto")]
    models.append(nn.parallel.DistributedDataParallel(nn.Linear(8, 4)))
    for m in models:
        m(torch.ones(2, 8)).sum().backward()
    for m in models[:3]:
        m.close()
    dist.destroy_process_group()
    return sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())


def test_no_thread_of_dpscale_outlives_the_process_group():
    assert run_ranks(engines_then_destroy, 2) == [[], []]
