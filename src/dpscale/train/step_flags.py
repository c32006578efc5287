"""`StepFlags`: the one small all-reduce per step that keeps every rank's decisions the same.

After the synced backward each rank contributes its loss sum, whether its gradient norm is
finite, whether it was asked to stop, and its local squared gradient norm (for the noise scale).
One all-reduce of these four numbers gives every rank the global loss and the same skip and stop
decisions. After averaging, a non-finite gradient anywhere is non-finite everywhere, but deciding
by a collective keeps ranks in lockstep even if a custom hook were to hide it on some rank; a
signal that reached any rank stops every rank after the same step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dpscale.comm.group_device import on_collective_device
from dpscale.engine.collective_log import CollectiveLog


@dataclass
class StepDecision:
    """What every rank agreed on for one step."""

    loss_sum: torch.Tensor  # the global batch's summed loss (float64, 0-d)
    skipped: bool  # some rank's gradient was non-finite: no update this step
    small_sq: float  # the ranks' local squared gradient norms, averaged (0.0 when not measured)


class StepFlags:
    """Reduces each step's flags and counts what the loop decides from them.

    `stop_requested()` returns why this rank should stop (e.g. "SIGTERM") or None; it is asked
    once per step. `skipped_in_a_row` is not checkpointed: a resume gives a diverging run its full
    allowance."""

    def __init__(
        self,
        *,
        group: dist.ProcessGroup | None,
        world_size: int,
        log: CollectiveLog,
        stop_requested: Callable[[], str | None] | None = None,
    ):
        self.group = group
        self.world_size = world_size
        self.log = log
        self.stop_requested: Callable[[], str | None] = stop_requested or (lambda: None)
        self.skipped_in_a_row = 0
        self.stop_agreed = False  # some rank was asked to stop: every rank stops after this step

    def reduce(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor, small_sq: float | None) -> StepDecision:
        """Collective: every rank's flags for this step, reduced; updates the counts."""
        stop = loss_sum.new_tensor(float(self.stop_requested() is not None))
        local_sq = loss_sum.new_tensor(small_sq if small_sq is not None else 0.0)
        flags = torch.stack([loss_sum, (~torch.isfinite(grad_norm)).to(torch.float64), stop, local_sq])
        flags = on_collective_device(flags, self.group)  # itself unless the model and group differ
        self.log.record("all_reduce", "step flags (loss, non-finite, stop, local grad norm)", flags)
        dist.all_reduce(flags, group=self.group)
        skipped = bool(flags[1] > 0)
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        self.stop_agreed = bool(flags[2] > 0)
        return StepDecision(loss_sum=flags[0], skipped=skipped, small_sq=float(flags[3]) / self.world_size)
