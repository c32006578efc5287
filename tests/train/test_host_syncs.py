"""The Trainer's host-sync budget: at most one per step (the step flags' read), counted on CPU.

On a GPU each read of a device tensor's value (or a tensor made from host data) stops the host
until the device catches up, so the loop cannot run ahead. The budget is one per step: the skip
and stop decisions, the loss, the gradient norm and the noise scale's norms come back in one read
(step_flags.py). Counted from the step after the collective check (`check_collectives_steps`,
which reads its records on purpose), over fp16, accumulation, the noise scale on every step,
clipping and several ranks.
"""

import pytest
import torch
import torch.distributed as dist

from dpscale.lab.multirank import run_ranks
from dpscale.train.config import TrainConfig
from dpscale.train.trainer import Trainer
from support.sync_count import count_syncs

BUDGET = 1


def count_per_step(rank, world, overrides):
    cfg = TrainConfig.from_flat(
        workload="synthetic",
        max_steps=6,
        progress="none",
        noise_scale_every=1,
        grad_clip_norm=1.0,
        check_collectives_steps=1,
        **overrides,
    )
    trainer = Trainer(cfg)
    counts, sites = [], []
    step = trainer._train_step

    def counted(batch):
        with count_syncs() as count:
            m = step(batch)
        counts.append(count.total)
        sites.append(dict(count.sites))
        return m

    trainer._train_step = counted
    result = trainer.fit()
    assert result.gradient_noise_scale is not None or world == 1
    return counts[cfg.engine.check_collectives_steps :], sites[cfg.engine.check_collectives_steps :]


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "overrides",
    [{}, {"precision": "fp16"}, {"accumulation_steps": 2}],
    ids=["fp32", "fp16", "accumulation"],
)
def test_one_worker_syncs_the_host_at_most_once_per_step(world_of_one, overrides):
    counts, sites = count_per_step(0, 1, overrides)
    assert max(counts) <= BUDGET, sites


@pytest.mark.slow
def test_two_workers_sync_the_host_at_most_once_per_step_noise_scale_included():
    for overrides in ({}, {"precision": "fp16"}):
        for counts, sites in run_ranks(count_per_step, 2, overrides):
            assert max(counts) <= BUDGET, sites


def test_the_counter_sees_each_kind_of_sync():
    t = torch.ones(2)
    with count_syncs() as count:
        t.sum().item()
        t.tolist()
        float(t[0])
        bool(t[0])
        int(t[0])
        t.new_tensor([1.0])
        torch.tensor(1.0)
        torch.full((), 1.0)  # a fill: no transfer
    assert count.total == 7
