"""A task by name: a built-in workload, or the user's `module:callable` returning a `dpscale.Task`.

Specs are strings so they travel to spawned workers, where each resolves its own copy. The
current directory goes on `sys.path` first, as for `python -m`, so `mytask:make` finds the
user's mytask.py. Torch's RNG is seeded before the user's module is imported and again before
its callable runs, so data either generates with torch's random functions is the same on every
rank (the caller's RNG state is left as it was). The user's module and callable may raise or call
sys.exit anywhere: that is bad input (UserCodeError, exit 2 naming what failed), never an exit
code of theirs, which could make a run that trained nothing look like a success.
"""

from __future__ import annotations

import importlib
import os
import re
import sys

import torch

from dpscale.errors import ConfigError, UserCodeError
from dpscale.workloads.builtin import WORKLOADS
from dpscale.workloads.task import Task

TASK_SPEC_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
TASK_CONVENTION = (
    "a built-in workload (" + ", ".join(WORKLOADS) + ") or module:callable, a function with no "
    "arguments in module.py (found from the current directory) that returns a dpscale.Task"
)


def is_task_spec(spec: str) -> bool:
    return spec in WORKLOADS or bool(TASK_SPEC_RE.match(spec))


def load_task(spec: str, *, seed: int = 0, flag: str = "--task") -> Task:
    """The Task `spec` names; a one-line ValueError starting with `flag` when it cannot."""
    if spec in WORKLOADS:
        return WORKLOADS[spec].task(seed)
    if not TASK_SPEC_RE.match(spec):
        raise ConfigError(f"{flag}: {spec!r} is not {TASK_CONVENTION}")
    module_name, _, attr = spec.partition(":")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    # seeded for the import too: a module that draws its data at import (as scripts do) runs
    # afresh in every process (each rank, the parent of `check equivalence`), and what ran there
    # before may have drawn from torch's RNG
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name is None or not module_name.startswith(e.name):
                raise _user_error(f"{flag}: the import of {module_name}", e) from None
            raise ConfigError(
                f"{flag}: cannot load {spec!r} ({_first_line(e)}); expected {TASK_CONVENTION}"
            ) from None
        except (Exception, SystemExit) as e:  # their module's own code failed
            raise _user_error(f"{flag}: the import of {module_name}", e) from None
        try:
            factory = getattr(module, attr)
        except AttributeError as e:
            raise ConfigError(
                f"{flag}: cannot load {spec!r} ({_first_line(e)}); expected {TASK_CONVENTION}"
            ) from None
        if not callable(factory):
            raise ConfigError(f"{flag}: {spec} is not callable; expected {TASK_CONVENTION}")
        torch.manual_seed(seed)
        try:
            task = factory()
        except ConfigError as e:  # Task's own validation: it names the field
            raise ConfigError(f"{flag}: {spec}() raised ValueError: {_first_line(e)}") from None
        except (Exception, SystemExit) as e:
            raise _user_error(f"{flag}: {spec}()", e) from None
    if not isinstance(task, Task):
        raise ConfigError(
            f"{flag}: {spec}() returned {type(task).__name__}; it must return a dpscale.Task(model, "
            "train_data, eval_data, loss=..., metrics=...)"
        )
    return task


def _user_error(what: str, e: BaseException) -> UserCodeError:
    return UserCodeError.from_exception(what, e)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
