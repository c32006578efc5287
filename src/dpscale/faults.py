"""Test-only fault injection, off unless the environment variable DPSCALE_FAULTS is set.

DPSCALE_FAULTS holds `;`-separated faults, each `name@key=value,key=value`, for example
`nan_grad@step=5,rank=1`. Code asks at a named point: `injected("nan_grad", step=5, rank=1)` is
true when a listed fault of that name matches every key the fault names; keys the fault leaves
out match anything (`raise@rank=1` fires at rank 1's first step). A key the point does not pass
never matches, so a misspelled key disables the fault instead of widening it. Every point also
passes `attempt`, the elastic restart count (TORCHELASTIC_RESTART_COUNT, 0 outside torchrun), so
`kill@step=15,rank=1,attempt=0` kills only the first attempt and the restarted one can finish.
Normal runs never set the variable, so each check is one environment lookup.

Named points (keys in brackets):
- `kill`, `hang`, `raise` [step, rank, world, attempt]: trainer, at the start of a step, before
  any of its collectives: SIGKILL this process / sleep forever / raise `InjectedFault`.
- `nan_grad` [step, rank, attempt]: trainer, after the reduction, before the skip decision: a NaN
  in this rank's first gradient.
- `perturb` [step, rank, param, attempt]: trainer, after the optimizer step: add 1e-3 to the
  first element of each matching parameter on this rank (a replica that drifted).
- `kill_in_checkpoint` [step, file, attempt]: checkpoint writer, after writing the file `file`
  (a payload stem such as `model`) into the temporary directory: SIGKILL this process.
"""

from __future__ import annotations

import os
import signal
import time

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
