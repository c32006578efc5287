"""Growing the global batch with the gradient noise scale (`--global-batch auto`), workers fixed.

McCandlish et al. 2018: a batch well below the noise scale B_noise wastes steps (each step could
average more samples at little extra cost in samples), one well above it wastes samples; the steps
to a target go as S(B) = S_min (1 + B_noise / B). The noise scale grows as the loss falls, so the
best batch grows during training; Pollux (Qiao et al., OSDI 2021) adapts it as the run goes by
maximising goodput = throughput x statistical efficiency. Here the batch changes by doubling or
halving the accumulation steps (the workers and their micro-batch stay), up to `max_global_batch`:

- the noise scale must have reached `grow_at` x the global batch for a doubling (2 by default:
  the doubled batch stays at or below B_noise, McCandlish's critical batch, which balances steps
  against samples; at 1, the first doubling came so early on digits that its step-count gain did
  not cover its step time and the step times undid it, see BENCHMARKS.md);
- and the doubled batch must not be predicted slower to the target: time to target goes as
  (1 + B_noise / B) x t(B), with t(B) the step time measured in this run at each batch tried
  (through the reduced gradients; the optimizer's step does not depend on the batch). A batch not
  tried yet is extrapolated linearly from two that were; with only one tried, the doubling is a
  probe, and the next decision halves back if the measured times say it does not pay.

Each change keeps the sampler's place in the epoch (`Trainer.set_batch_split`, as a world-size
change does) and replans the steps left. Paired with `AdaScaleGain` (adascale.py), the learning
rate follows the batch. Decisions use the noise scale every rank holds alike, the step count and
step times averaged over ranks (one small all-reduce per decision), so every rank changes the batch
at the same step. The estimate needs two gradients per step: several workers, or one worker with
at least two micro-batches.

A checkpoint keeps the changes so far and the step times agreed at the last decision
(`state_dict`); a resume continues at the grown batch with those times (the times measured after
that decision and before the checkpoint are measured again), or with no times when the world size
changed, since a step's time depends on it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from dpscale.comm.group_device import collective_device
from dpscale.engine.clock import Clock, HostClock
from dpscale.train.callbacks import TrainerCallback

# halve back only when the smaller batch is predicted at least 10% sooner to the target
SHRINK_MARGIN = 0.9
# --global-batch auto grows to at most this many times the start batch
MAX_GROWTH = 16


def time_to_target(b_simple: float, global_batch: int, step_s: float) -> float:
    """Relative time to a target at `global_batch`: S(B) t(B) up to the constant S_min."""
    return (1.0 + b_simple / global_batch) * step_s


class GrowBatch(TrainerCallback):
    """Doubles (or halves back) the accumulation steps by the noise scale and the measured step times.

    `check_every`: steps between decisions; `min_updates`: noise-scale measurements needed before
    the first one (an estimate from a handful of steps is mostly noise); `grow_at`: the noise scale
    must be at least this many times the global batch before it doubles (2: the doubled batch is
    still at or below it). `changes` records (step, new global batch)."""

    def __init__(
        self, *, max_global_batch: int, check_every: int = 4, min_updates: int = 8, grow_at: float = 2.0
    ):
        if max_global_batch < 1 or check_every < 1 or min_updates < 1:
            raise ValueError("max_global_batch, check_every and min_updates must be >= 1")
        if not grow_at > 0:
            raise ValueError(f"grow_at must be > 0, got {grow_at}")
        self.max_global_batch = max_global_batch
        self.check_every = check_every
        self.min_updates = min_updates
        self.grow_at = grow_at
        self.changes: list[tuple[int, int]] = []
        self.step_s: dict[int, list[float]] = {}  # accumulation steps -> this rank's step times
        self.agreed_s: dict[int, float] = {}  # what agreed_step_s gave at the last decision
        # the trainer's clock (engine/clock.py: CUDA events on a GPU, where host time would
        # measure the launches); steps timed and not yet read: (accumulation, start, end)
        self._clock: Clock = HostClock()
        self._t0: Any = None
        self._timed: list[tuple[int, Any, Any]] = []
        self._last_k = 0

    def state_dict(self) -> dict:
        """What a checkpoint keeps (the same on every rank): the changes and the agreed step times."""
        return {"changes": [list(c) for c in self.changes], "fastest_s": dict(self.agreed_s)}

    def load_state_dict(self, state: object, *, same_world: bool) -> None:
        """Continue from `state_dict()`'s output (a checkpoint's, so checked: ValueError naming what
        is wrong); the step times only if the world size is the one that measured them."""
        changes = state.get("changes") if isinstance(state, dict) else None
        fastest = state.get("fastest_s") if isinstance(state, dict) else None
        if not isinstance(changes, list) or not all(
            isinstance(c, list | tuple) and len(c) == 2 and all(type(v) is int and v >= 0 for v in c)
            for c in changes
        ):
            raise ValueError(f"batch growth changes {changes!r} are not (step, global batch) pairs")
        if not isinstance(fastest, dict) or not all(
            type(k) is int and k >= 1 and type(t) is float and math.isfinite(t) and t > 0
            for k, t in fastest.items()
        ):
            raise ValueError(f"batch growth step times {fastest!r} are not accumulation -> seconds")
        self.changes = [(step, batch) for step, batch in changes]
        self.agreed_s = dict(fastest) if same_world else {}
        self.step_s = {k: [t] for k, t in self.agreed_s.items()}

    def wanted_accumulation(
        self,
        *,
        b_simple: float | None,
        global_batch: int,
        accumulation: int,
        step_s: dict[int, float] | None = None,
    ) -> int:
        """The accumulation steps to use from now on (the current ones when nothing changes).

        `step_s`: the fastest step time at each accumulation tried so far, as `agreed_step_s`
        gives it (None or empty: the noise scale alone decides, as if a step took the same time at
        any batch)."""
        if b_simple is None or not b_simple > 0:
            return accumulation
        base = global_batch // accumulation  # the global batch at one accumulation step
        times = step_s or {}

        def cost(k: int) -> float | None:
            t = times.get(k) or _extrapolate(times, k)
            return None if t is None else time_to_target(b_simple, base * k, t)

        here = cost(accumulation)
        halved = cost(accumulation // 2) if accumulation > 1 and accumulation // 2 in times else None
        if halved is not None and here is not None:
            # the last doubling did not pay: back (by a margin, so load noise does not flap it)
            if halved < SHRINK_MARGIN * here:
                return accumulation // 2
        grown = accumulation
        while b_simple >= self.grow_at * base * grown and base * grown * 2 <= self.max_global_batch:
            now, doubled = cost(grown), cost(2 * grown)
            if now is not None and doubled is not None and doubled >= now:
                break  # predicted slower to the target: the step grows faster than the steps shrink
            grown *= 2
            if times and doubled is None:
                break  # one probe at a time: measure it before going further
        return grown

    def on_batch(self, trainer, batch) -> None:
        self._clock = getattr(trainer, "clock", None) or self._clock
        self._t0 = self._clock.stamp()

    def after_reduce(self, trainer, grads) -> None:
        k = trainer.state.accumulation_steps
        if k != self._last_k:  # the first step at a batch sets up buffers and caches: not timed
            self._last_k = k
            return
        self._timed.append((k, self._t0, self._clock.stamp()))

    def _read_times(self) -> None:
        """The timed steps into `step_s`. Their stamps precede the step flags' read, the step's one
        sync, so the device has passed them: the wait returns at once, and every rank holds the
        same steps' times when they decide together."""
        clock, timed = self._clock, self._timed
        clock.wait([t for _, start, end in timed for t in (start, end)])
        for k, start, end in timed:
            self.step_s.setdefault(k, []).append(clock.elapsed_ms(start, end) / 1e3)
        timed.clear()

    def agreed_step_s(self, trainer) -> dict[int, float]:
        """The fastest step time per accumulation tried, averaged over ranks (the same dict on
        every rank: every rank has run the same steps at the same accumulations). The minimum,
        not the median: on a shared host a few steps' median still moves with the load, which
        made decisions flap between two batches."""
        ks = sorted(self.step_s)
        group = getattr(trainer, "group", None)
        fastest = [min(self.step_s[k]) for k in ks]
        if ks and dist.is_available() and dist.is_initialized():
            summed = torch.tensor(fastest, dtype=torch.float64, device=collective_device(group))
            dist.all_reduce(summed, group=group)
            fastest = (summed / dist.get_world_size(group)).tolist()
        return dict(zip(ks, fastest, strict=True))

    def after_step(self, trainer) -> None:
        self._read_times()
        if trainer.step % self.check_every or trainer.noise_scale.estimator.updates < self.min_updates:
            return
        state = trainer.state
        self.agreed_s = self.agreed_step_s(trainer)
        accumulation = self.wanted_accumulation(
            b_simple=trainer.noise_scale.b_simple,
            global_batch=state.global_batch,
            accumulation=state.accumulation_steps,
            step_s=self.agreed_s,
        )
        if accumulation != state.accumulation_steps:
            trainer.set_batch_split(state.micro_batch, accumulation)
            trainer.total_steps = trainer.plan_total_steps()
            self.changes.append((trainer.step, state.global_batch))


def _extrapolate(times: dict[int, float], k: int) -> float | None:
    """t(k) from the straight line through the two tried accumulations nearest below k (a step
    is a fixed cost plus one per micro-batch); None with fewer than two."""
    below = sorted(j for j in times if j < k)[-2:]
    if len(below) < 2:
        return None
    (k1, t1), (k2, t2) = ((j, times[j]) for j in below)
    return max(t2, t2 + (t2 - t1) / (k2 - k1) * (k - k2))
