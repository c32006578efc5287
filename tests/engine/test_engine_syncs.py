"""The engine's host-sync budget: none on any step, the noise scale's measured steps included.

Counted on CPU (tests/support/sync_count.py): each counted call is one that stops the host for the
device on a GPU. The noise scale's norms stay on the device and reach the observers once readable.
"""

import torch
from torch import nn

from dpscale import DistributedDataParallel
from dpscale.engine.noise_scale import NoiseScaleObserver
from support.echo_group import EchoGroup
from support.sync_count import count_syncs


def test_an_engine_step_makes_no_host_sync_even_when_measuring_the_noise_scale():
    torch.manual_seed(0)
    ddp = DistributedDataParallel(
        nn.Sequential(nn.Linear(4, 64), nn.Linear(64, 2)), process_group=EchoGroup(2), init_sync=False
    )
    ddp.set_noise_scale_observer(NoiseScaleObserver(every=1))  # norms on every step, both of them
    counts = []
    for _ in range(4):
        with count_syncs() as count:
            ddp(torch.randn(3, 4)).sum().backward()
        counts.append(count.total)
        assert ddp.last_step_stats.grad_sq_norm_global is not None  # measured, and read
    assert counts == [0, 0, 0, 0]
    ddp.close()
