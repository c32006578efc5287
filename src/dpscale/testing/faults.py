"""Test-only fault injection through trainer callbacks, off unless DPSCALE_FAULTS is set.

The trainer knows nothing of faults: a test hands it `FaultInjector()` (`Trainer(cfg,
callbacks=[FaultInjector()])`), or, for runs whose workers the CLI starts, sets
DPSCALE_CALLBACKS=dpscale.testing.faults:FaultInjector next to DPSCALE_FAULTS.

DPSCALE_FAULTS holds `;`-separated faults, each `name@key=value,key=value`, for example
`nan_grad@step=5,rank=1`. A callback asks at a named point: `injected("nan_grad", step=5, rank=1)` is
true when a listed fault of that name matches every key the fault names; keys the fault leaves
out match anything (`raise@rank=1` fires at rank 1's first step). A key the point does not pass
never matches, so a misspelled key disables the fault instead of widening it. Every point also
passes `attempt`, the elastic restart count (TORCHELASTIC_RESTART_COUNT, 0 outside torchrun), so
`kill@step=15,rank=1,attempt=0` kills only the first attempt and the restarted one can finish.

Named points (keys in brackets), each at a trainer callback:
- `kill`, `hang`, `raise`, `refuse` [step, rank, world, attempt]: `on_batch`, at the start of a
  step, before any of its collectives: SIGKILL this process / sleep forever / raise
  `InjectedFault` / raise a ConfigError (bad input seen by this rank only).
- `nan_grad` [step, rank, attempt]: `after_reduce`, before the skip decision: a NaN in this rank's
  first gradient.
- `perturb` [step, rank, param, attempt]: `after_step`: add 1e-3 to the first element of each
  matching parameter on this rank (a replica that drifted).
- `kill_in_checkpoint` [step, file, attempt]: `on_checkpoint_file`, after the writer wrote the file
  `file` (a payload stem such as `model`) into the temporary directory: SIGKILL this process.
"""

from __future__ import annotations

import os
import signal
import time

import torch

from dpscale.errors import ConfigError
from dpscale.train.callbacks import TrainerCallback

ENV = "DPSCALE_FAULTS"


class InjectedFault(RuntimeError):
    """Raised by the `raise` fault point."""


def _parse(text: str) -> list[tuple[str, dict[str, str]]]:
    faults = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        name, _, args = item.partition("@")
        keys = dict(kv.split("=", 1) for kv in args.split(",") if kv)
        faults.append((name.strip(), {k.strip(): v.strip() for k, v in keys.items()}))
    return faults


def active() -> bool:
    """True when any fault is configured; lets a point skip per-parameter work in normal runs."""
    return bool(os.environ.get(ENV))


def injected(name: str, **where: object) -> bool:
    text = os.environ.get(ENV)
    if not text:
        return False
    where.setdefault("attempt", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for fault, keys in _parse(text):
        if fault == name and all(str(where.get(k)) == v for k, v in keys.items()):
            return True
    return False


def kill_self() -> None:
    """Die the way an OOM-killed or preempted worker does: no cleanup, no exception, no flush."""
    os.kill(os.getpid(), signal.SIGKILL)


def hang_forever() -> None:
    """Stop responding without exiting, the way a worker stuck in I/O or a deadlock does."""
    while True:
        time.sleep(3600)


class FaultInjector(TrainerCallback):
    """Fires the faults DPSCALE_FAULTS lists at the trainer's callback points."""

    def on_batch(self, trainer, batch) -> None:
        where = dict(step=trainer.step + 1, rank=trainer.rank, world=trainer.world_size)
        if injected("kill", **where):
            kill_self()
        if injected("hang", **where):
            hang_forever()
        if injected("refuse", **where):
            raise ConfigError(f"injected bad input: step {trainer.step + 1}, rank {trainer.rank}")
        if injected("raise", **where):
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            step, rank = trainer.step + 1, trainer.rank
            raise InjectedFault(f"injected fault: step {step}, rank {rank}, attempt {attempt}")

    def after_reduce(self, trainer, grads: list[torch.Tensor]) -> None:
        if grads and injected("nan_grad", step=trainer.step + 1, rank=trainer.rank):
            grads[0].view(-1)[0] = float("nan")  # after the reduction: only this rank sees it

    @torch.no_grad()
    def after_step(self, trainer) -> None:
        if not active():  # per-parameter lookups only when some fault is configured
            return
        for name, p in trainer.model.module.named_parameters():
            if injected("perturb", step=trainer.step, rank=trainer.rank, param=name):
                p.view(-1)[0] += 1e-3

    def on_checkpoint_file(self, step: int, stem: str) -> None:
        if injected("kill_in_checkpoint", step=step, file=stem):
            kill_self()  # a writer killed between files
