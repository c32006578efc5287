"""The observer seam: each synced step's stats and norms reach the observers, and nothing outside
the engine reaches into the reducer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from dpscale import DistributedDataParallel
from dpscale.engine.noise_scale import NoiseScaleObserver
from dpscale.engine.observers import GradNorms, StepObserver
from dpscale.engine.stats import StepStats
from support.echo_group import EchoGroup

SRC = Path(__file__).resolve().parents[2] / "src" / "dpscale"


class Recorder(StepObserver):
    wants_reduced_norm = True

    def __init__(self, every: int | None = None):
        self.every = every
        self.seen: list[tuple[StepStats, GradNorms | None]] = []

    def wants_grad_norms(self, step: int) -> bool:
        return self.every is not None and step % self.every == 0

    def on_step(self, stats: StepStats, norms: GradNorms | None) -> None:
        self.seen.append((stats, norms))


def _ddp(world: int = 2) -> DistributedDataParallel:
    torch.manual_seed(0)
    return DistributedDataParallel(nn.Linear(4, 2), process_group=EchoGroup(world), init_sync=False)


def _steps(ddp: DistributedDataParallel, n: int) -> None:
    for _ in range(n):
        ddp(torch.randn(3, 4)).sum().backward()
        with ddp.no_sync():  # not a synced step: no call
            ddp(torch.randn(3, 4)).sum().backward()


def test_observers_get_every_synced_steps_stats_and_the_norms_they_ask_for():
    ddp = _ddp()
    ddp.set_noise_scale_observer(None)
    stats_only, with_norms = Recorder(), Recorder(every=2)
    ddp.add_step_observer(stats_only)
    ddp.add_step_observer(with_norms)
    _steps(ddp, 4)
    assert [s.step for s, _ in stats_only.seen] == [1, 2, 3, 4]
    assert stats_only.seen[-1][0] is ddp.last_step_stats
    # norms on the steps one observer asked for, delivered to every observer
    assert [n is not None for _, n in with_norms.seen] == [True, False, True, False]
    assert [n is not None for _, n in stats_only.seen] == [True, False, True, False]
    norms = with_norms.seen[0][1]
    assert norms is not None and norms.reduced_sq is not None and norms.world_size == 2 and norms.all_ranks
    assert with_norms.seen[0][0].grad_sq_norm_local == norms.local_sq
    ddp.remove_step_observer(with_norms)
    _steps(ddp, 2)
    assert len(with_norms.seen) == 4 and len(stats_only.seen) == 6
    assert all(n is None for _, n in stats_only.seen[4:])  # nobody asks: nothing measured
    ddp.close()


def test_no_observer_measures_nothing():
    ddp = _ddp()
    ddp.set_noise_scale_observer(None)
    assert ddp.reducer.observers == [ddp._stats]  # torch's logging data: asks for no norms
    _steps(ddp, 2)
    assert ddp.last_step_stats is not None and ddp.last_step_stats.grad_sq_norm_local is None
    ddp.close()


def test_the_default_noise_scale_observer_and_the_synced_step_count():
    ddp = _ddp()
    assert isinstance(ddp.noise_scale, NoiseScaleObserver) and ddp.noise_scale.every == 8
    ddp.set_synced_steps(7)  # a resumed run: the next step is the 8th, measured
    _steps(ddp, 2)
    assert ddp.last_step_stats.step == 9
    assert ddp.noise_scale.estimator.updates == 1
    with pytest.raises(ValueError, match="every"):
        NoiseScaleObserver(every=0)
    ddp.close()


def test_another_observers_wishes_do_not_change_the_noise_scales_every():
    ddp = _ddp()  # the default noise-scale observer measures on every 8th synced step
    ddp.add_step_observer(Recorder(every=1))  # norms on every step, for this one
    _steps(ddp, 9)
    assert ddp.noise_scale.estimator.updates == 2  # steps 0 and 8 (counted from 0), not 9
    ddp.close()


def _reducer_uses(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), filename=str(path))
    lines = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "reducer"]
    lines += [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and n.value == "reducer" and isinstance(n.value, str)
    ]
    return lines


def test_nothing_outside_the_engine_touches_the_reducer():
    """The engine is configured and measured through its public methods and the observer seam
    (reading or setting `model.reducer.*` from outside couples callers to its internals)."""
    offenders = [
        f"{path.relative_to(SRC)}:{line}"
        for path in sorted(SRC.rglob("*.py"))
        if "engine" not in path.relative_to(SRC).parts[:1]
        for line in _reducer_uses(path)
    ]
    assert not offenders, f"use the engine's public methods or add_step_observer instead: {offenders}"
