"""`StepFlags`: the one small all-reduce per step that keeps every rank's decisions the same.

After the synced backward each rank contributes its loss sum, whether its gradient norm is
finite, whether it was asked to stop, and its local squared gradient norm (for the noise scale).
One all-reduce of these four numbers gives every rank the global loss and the same skip and stop
decisions. After averaging, a non-finite gradient anywhere is non-finite everywhere, but deciding
by a collective keeps ranks in lockstep even if a custom hook were to hide it on some rank; a
signal that reached any rank stops every rank after the same step.

Reading the result is the step's one host sync: the flags, the gradient norm and whatever else
the loop needs on the host this step (`read_along`) come back in one transfer. The flags are
built on the device without host-to-device copies (`new_full` passes a number to a fill kernel).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dpscale.comm.group_device import on_collective_device
from dpscale.engine.collective_log import CollectiveLog


@dataclass
class StepDecision:
    """What every rank agreed on for one step."""

    loss_sum: float  # the global batch's summed loss
    skipped: bool  # some rank's gradient was non-finite: no update this step
    small_sq: float  # the ranks' local squared gradient norms, averaged (0.0 when not measured)
    grad_norm: float = 0.0  # this rank's gradient norm, as given
    read_along: list[float] = field(default_factory=list)  # `reduce`'s read_along, on the host


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

    def reduce(
        self,
        loss_sum: torch.Tensor,
        grad_norm: torch.Tensor,
        small_sq: torch.Tensor | float | None,
        *,
        read_along: Sequence[torch.Tensor] = (),
    ) -> StepDecision:
        """Collective: every rank's flags for this step, reduced; updates the counts.

        `loss_sum`: this rank's (0-d float64); `small_sq`: its local squared gradient norm (a
        0-d tensor, a number, or None: not measured); `read_along`: 0-d tensors of this rank's
        to bring to the host in the same read (not reduced)."""
        stop = loss_sum.new_full((), float(self.stop_requested() is not None))
        if isinstance(small_sq, torch.Tensor):
            local_sq = small_sq.to(loss_sum)
        else:
            local_sq = loss_sum.new_full((), small_sq if small_sq is not None else 0.0)
        flags = torch.stack([loss_sum, (~torch.isfinite(grad_norm)).to(torch.float64), stop, local_sq])
        flags = on_collective_device(flags, self.group)  # itself unless the model and group differ
        self.log.record("all_reduce", "step flags (loss, non-finite, stop, local grad norm)", flags)
        dist.all_reduce(flags, group=self.group)
        mine = [t.reshape(1).to(flags) for t in (grad_norm, *read_along)]
        values = torch.cat([flags, *mine]).tolist()  # the step's one host sync
        skipped = values[1] > 0
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        self.stop_agreed = values[2] > 0
        return StepDecision(
            loss_sum=values[0],
            skipped=skipped,
            small_sq=values[3] / self.world_size,
            grad_norm=values[4],
            read_along=values[5:],
        )
