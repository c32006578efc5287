"""What `dpscale run` watches in a user's script besides its DDP model, to split steps into phases.

The DDP stand-in (launch/run_child.py) sees forwards only. A step's backward, its optimizer step,
an evaluation or a checkpoint happen outside it, so while telemetry is on the worker watches them
through torch's public seams: `torch.Tensor.backward` wrapped to stamp its start and end, a global
optimizer step post-hook, `torch.save` wrapped to count checkpoints. Each stamp goes to the
telemetry of every DDP model the script built (engine/telemetry.py `StepMarks`).

A script that builds no DDP model (the common "wrap only when world_size > 1" at one worker) still
has steps: `Unwrapped` takes them from the module forwards at the top of the call stack (a module
with trainable parameters, called while no other module's forward runs) and ends each at the
optimizer's `step()`. Its hooks come off as soon as the script builds a DDP model.

Once a DDP model exists, its wrapper counts the evaluations run through it, but a script may
evaluate the module inside it directly: Hugging Face's Trainer trains the DDP model and evaluates
`self.model`, the module it wrapped. `BareEvaluations` counts those too, so a step that held one is
classified as such rather than timed as training.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from dpscale.engine.telemetry import StepTelemetry, batch_size


def _trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


class Unwrapped:
    """Step telemetry of a script's top-level model when no DDP wraps it."""

    def __init__(self, telemetry: StepTelemetry) -> None:
        self.telemetry = telemetry
        self.module: nn.Module | None = None  # the last top-level model seen training
        self._depth = 0
        self._call: tuple[nn.Module, float] | None = None  # the top-level training forward running
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._pre),
            nn.modules.module.register_module_forward_hook(self._post, with_kwargs=True, always_call=True),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _pre(self, module: nn.Module, args: tuple) -> None:
        self._depth += 1
        if self._depth > 1 or not _trainable(module):  # inside a model, or a loss module
            return
        if not (module.training and torch.is_grad_enabled()):
            self.telemetry.marks.evaluations += 1
            return
        self.module = module
        self._call = (module, time.perf_counter())
        # its samples come at the end of the call, where the keyword inputs are seen too
        self.telemetry.on_forward((), {}, False, lambda: (None, None))

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0 and self._call is not None and self._call[0] is module:
            self.telemetry.add_samples(batch_size(args, kwargs))
            self.telemetry.marks.forward_total_s += time.perf_counter() - self._call[1]
            self._call = None


class BareEvaluations:
    """Evaluation forwards (eval mode or no grad) of the module a DDP model wraps, called past the
    wrapper; counted on the wrapper's telemetry, as the wrapper counts those it runs itself."""

    def __init__(self, ddp: nn.Module, telemetry: StepTelemetry) -> None:
        self.telemetry = telemetry
        self._in_wrapper = 0  # the wrapper's own forwards call the module too: counted there
        inner = ddp.module
        assert isinstance(inner, nn.Module)
        self._handles = [
            ddp.register_forward_pre_hook(self._enter),
            ddp.register_forward_hook(self._leave, always_call=True),
            inner.register_forward_pre_hook(self._bare),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _enter(self, module: nn.Module, args: tuple) -> None:
        self._in_wrapper += 1

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._in_wrapper -= 1

    def _bare(self, module: nn.Module, args: tuple) -> None:
        if not self._in_wrapper and not (module.training and torch.is_grad_enabled()):
            self.telemetry.marks.evaluations += 1


class ScriptWatch:
    """Stamps each backward, optimizer step and checkpoint on the telemetries in `telemetries`."""

    def __init__(self) -> None:
        self.telemetries: list[StepTelemetry] = []
        self.unwrapped: Unwrapped | None = None
        self.bare: list[BareEvaluations] = []  # one per DDP model built

    def install(self, unwrapped_telemetry: StepTelemetry | None) -> None:
        """Start watching; with `unwrapped_telemetry`, also time a model no DDP wraps (until one does)."""
        backward = torch.Tensor.backward
        save = torch.save

        def timed_backward(tensor, *args, **kwargs):
            start = time.perf_counter()
            try:
                return backward(tensor, *args, **kwargs)
            finally:
                span = (start, time.perf_counter())
                for t in self.telemetries:
                    t.marks.backward = span
                    t.marks.backward_total_s += span[1] - span[0]

        def counted_save(*args, **kwargs):
            for t in self.telemetries:
                t.marks.checkpoints += 1
            return save(*args, **kwargs)

        torch.Tensor.backward = timed_backward  # type: ignore[method-assign,assignment]  # the point: every backward
        torch.save = counted_save
        register_optimizer_step_post_hook(self._after_optimizer_step)
        if unwrapped_telemetry is not None:
            self.unwrapped = Unwrapped(unwrapped_telemetry)
            self.telemetries.append(unwrapped_telemetry)

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        now = time.perf_counter()
        for t in self.telemetries:
            t.marks.optimizer_end = now
            t.marks.optimizer_steps += 1
        if self.unwrapped is not None:
            self.unwrapped.telemetry.end_step()

    def ddp_built(self, telemetry: StepTelemetry | None, ddp: nn.Module | None = None) -> None:
        """A DDP model exists: its own telemetry replaces the unwrapped one, and the evaluations
        the script runs on `ddp`'s module past the wrapper count on it too."""
        if self.unwrapped is not None:
            self.unwrapped.remove()
            self.telemetries.remove(self.unwrapped.telemetry)
            self.unwrapped = None
        if telemetry is not None:
            self.telemetries.append(telemetry)
            if ddp is not None:
                self.bare.append(BareEvaluations(ddp, telemetry))
