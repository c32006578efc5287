"""Accelerate: change one import and `accelerator.prepare` wraps models in dpscale's engine.

    from dpscale.integrations.accelerate import Accelerator  # instead of: from accelerate import Accelerator

Everything else stays Accelerate's: `unwrap_model`, `save_model` and `get_state_dict` find the
engine through their isinstance checks on torch's DistributedDataParallel (it is one), so keys come
out unprefixed, and `accumulate()` / `no_sync()` turn gradient synchronization off through the
engine's `no_sync`. `DistributedDataParallelKwargs` and a comm hook pass through as for torch's DDP.
A model that is already wrapped in a DistributedDataParallel (torch's or dpscale's) is refused.
"""

from __future__ import annotations

from contextlib import contextmanager

import accelerate
import torch

from dpscale.engine import DistributedDataParallel


class Accelerator(accelerate.Accelerator):
    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode=False
    ):
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError(
                f"prepare: the model is already wrapped in {type(model).__module__}.DistributedDataParallel; "
                "pass the unwrapped model (its .module)"
            )
        with _engine_as_torch_ddp():
            return super().prepare_model(
                model, device_placement=device_placement, evaluation_mode=evaluation_mode
            )


@contextmanager
def _engine_as_torch_ddp():
    # Accelerate builds `torch.nn.parallel.DistributedDataParallel(model, ...)` by that name;
    # for the duration of this one call the name is dpscale's engine. Accelerate's isinstance
    # checks afterwards use torch's class again, which the engine subclasses.
    import torch.nn.parallel as parallel

    torch_ddp = parallel.DistributedDataParallel
    parallel.DistributedDataParallel = DistributedDataParallel
    try:
        yield
    finally:
        parallel.DistributedDataParallel = torch_ddp
