"""Trainer callbacks: the points where code outside the loop may look at, or act on, a run.

A callback subclasses `TrainerCallback` and overrides the points it needs; every point does
nothing by default. The trainer calls them on every rank, in the order the callbacks were given.
This is how fault injection (`dpscale.testing.faults`) reaches the loop without the loop importing
test code; instrumentation of your own plugs in the same way.

A run started by the CLI (`dpscale train`) or torchrun (`-m dpscale.launch.worker`) builds its
Trainer inside the workers, where no object of yours can be handed over; there the environment
variable DPSCALE_CALLBACKS names them: `module:factory[;module:factory]`, each factory called with
no arguments returning one callback.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from dpscale.errors import ConfigError

if TYPE_CHECKING:  # annotations only; at run time this module knows no trainer
    from dpscale.data.sampler import StepBatch

ENV = "DPSCALE_CALLBACKS"


class TrainerCallback:
    """Override the points you need; `trainer` is the running `dpscale.Trainer`."""

    def on_batch(self, trainer, batch: StepBatch) -> None:
        """A step's batch is drawn; the step has issued no collective yet (`trainer.step` is the
        number of steps done)."""

    def after_reduce(self, trainer, grads: list[torch.Tensor]) -> None:
        """The gradients are reduced; the skip decision (non-finite on any rank) comes next."""

    def after_step(self, trainer) -> None:
        """The optimizer step is done (or skipped) and `trainer.step` counts it."""

    def on_checkpoint_file(self, step: int, stem: str) -> None:
        """Rank 0 wrote the checkpoint file `stem` (e.g. "model") of `step` into its temporary
        directory; the checkpoint is not yet complete."""


def callbacks_from_env(environ: dict[str, str] | None = None) -> list[TrainerCallback]:
    """The callbacks DPSCALE_CALLBACKS names (see the module docstring); [] when it is unset."""
    text = (os.environ if environ is None else environ).get(ENV, "")
    callbacks = []
    for spec in filter(None, (s.strip() for s in text.split(";"))):
        module_name, _, attr = spec.partition(":")
        if not module_name or not attr:
            raise ConfigError(f"{ENV}: {spec!r} is not module:factory, e.g. mypkg.probes:make_probe")
        factory = getattr(importlib.import_module(module_name), attr)
        callbacks.append(factory())
    return callbacks


def checked(callbacks: Sequence[TrainerCallback]) -> list[TrainerCallback]:
    bad = [type(c).__name__ for c in callbacks if not isinstance(c, TrainerCallback)]
    if bad:
        names = ", ".join(bad)
        raise TypeError(f"callbacks: {names} do not subclass dpscale.train.callbacks.TrainerCallback")
    return list(callbacks)
