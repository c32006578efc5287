"""The next step's batch is loaded while the device works on this one, and resume stays exact.

The prefetched step is not counted in the sampler's position (what a checkpoint saves), and a
dataset that draws from the global RNG while loading (a random augmentation, no loader workers)
draws the same numbers in a resumed run as in one never interrupted.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from dpscale.train.callbacks import TrainerCallback
from dpscale.train.config import TrainConfig
from dpscale.train.result import param_sha256
from dpscale.train.trainer import Trainer
from dpscale.workloads.builtin import _ce
from dpscale.workloads.task import Task


class Augmented(Dataset):
    """Samples with noise drawn from torch's global RNG as they are loaded; records each load."""

    def __init__(self, n=48):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)
        self.loaded: list[int] = []

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.loaded.append(i)
        return self.x[i] + 0.1 * torch.randn(5), self.y[i]


def _task():
    return Task(lambda: nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)), Augmented(), loss=_ce)


def _config(**kw):
    base = dict(global_batch=8, lr=0.5, optimizer="sgd", progress="none", seed=1, data_workers=0)
    return TrainConfig.from_flat(**(base | kw))


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class LoadedAhead(TrainerCallback):
    """At each step's reduction: how many samples the dataset had loaded, and the sampler's step."""

    def __init__(self, data):
        self.data, self.seen = data, []

    def after_reduce(self, trainer, grads):
        self.seen.append((len(self.data.loaded), trainer.sampler.step_in_epoch))


def test_the_next_step_is_loaded_before_this_one_ends_and_the_sampler_does_not_count_it(world_of_one):
    task = _task()
    spy = LoadedAhead(task.train_data)
    Trainer(_config(max_steps=3), task, callbacks=[spy]).fit()
    # at step k's reduction step k + 1's 8 samples are in too (not after the last step), while
    # the sampler's position is step k's
    assert spy.seen == [(16, 1), (24, 2), (24, 3)]


def test_resume_is_bit_exact_with_prefetch_and_a_loader_that_draws_random_numbers(world_of_one, tmp_path):
    full = Trainer(_config(max_steps=5), _task())
    full.fit()
    # stopped after step 3 (a preemption): its checkpoint is saved with step 4 already loaded
    calls = iter(range(100))
    stop = lambda: "SIGTERM" if next(calls) == 2 else None
    ckpt = str(tmp_path / "ck")
    stopped = Trainer(_config(max_steps=5, checkpoint_dir=ckpt), _task(), stop_requested=stop)
    stopped.fit()
    assert stopped.stopped_by is not None and stopped.step == 3
    resumed = Trainer(_config(max_steps=5, checkpoint_dir=ckpt, resume=True), _task())
    resumed.fit()
    assert resumed.resumed_from == 3
    assert param_sha256(resumed._module) == param_sha256(full._module)
    # a checkpoint in the middle of a run (a prefetch pending) leaves the run itself unchanged
    mid = Trainer(_config(max_steps=5, checkpoint_dir=str(tmp_path / "mid"), checkpoint_every=2), _task())
    mid.fit()
    assert param_sha256(mid._module) == param_sha256(full._module)


class Draws(TrainerCallback):
    """Draws from torch's global RNG at every point of a step a callback sees (e.g. a random
    probe or noise injection), and records what it drew."""

    def __init__(self):
        self.drawn: list[float] = []

    def on_batch(self, trainer, batch):
        self.drawn.append(torch.rand(()).item())

    def after_reduce(self, trainer, grads):
        self.drawn.append(torch.rand(()).item())

    def after_step(self, trainer):
        self.drawn.append(torch.rand(()).item())


def test_resume_is_bit_exact_when_callbacks_draw_random_numbers_after_the_prefetch(world_of_one, tmp_path):
    # the prefetch loads step k + 1 before step k's after_reduce and after_step callbacks run: the
    # checkpoint must hold the RNGs after their draws, not as they were before the prefetch
    full_draws = Draws()
    full = Trainer(_config(max_steps=5), _task(), callbacks=[full_draws])
    full.fit()
    calls = iter(range(100))
    stop = lambda: "SIGTERM" if next(calls) == 2 else None
    ckpt = str(tmp_path / "ck")
    config = _config(max_steps=5, checkpoint_dir=ckpt)
    stopped = Trainer(config, _task(), stop_requested=stop, callbacks=[Draws()])
    stopped.fit()
    assert stopped.step == 3
    resumed_draws = Draws()
    config = _config(max_steps=5, checkpoint_dir=ckpt, resume=True)
    resumed = Trainer(config, _task(), callbacks=[resumed_draws])
    resumed.fit()
    assert resumed.resumed_from == 3
    assert resumed_draws.drawn == full_draws.drawn[-len(resumed_draws.drawn) :]
    assert param_sha256(resumed._module) == param_sha256(full._module)
