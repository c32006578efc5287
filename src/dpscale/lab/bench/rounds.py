"""Alternating rounds: the one way the lab times variants against each other on a shared machine.

Every variant (an engine, a transport, the bare model) runs a round of several steps in turn, and
the order rotates by one each round, so a burst of other load or a slow drift lands on all variants
alike; a figure is then a median over rounds, or a median of per-round differences. Rounds of
several steps rather than one step each: every step would otherwise start with caches the other
variants filled, which slows a small model's bare step more than its wrapped one and hid a third
of its engine overhead (predict/profile.py measured 0.30 ms per-step alternation vs 0.45 ms in
rounds of 10 on digits, and 0.45 ms is what a training run pays).

Used by the scaling and engine benches (bench/scaling_rank.py), the profile (predict/profiling.py)
and the sync probe (predict/sync.py). `quantile` gives the p10/p90 beside a median: every bench's
spread is taken the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import TypeVar

V = TypeVar("V", bound=Hashable)
T = TypeVar("T")


def run_rounds(
    variants: Sequence[V], step: Callable[[V], T], round_sizes: Iterable[int]
) -> dict[V, list[list[T]]]:
    """Run `step(variant)` in alternating rounds; per variant, per round, the steps' results in order.

    Round r runs `round_sizes`' r-th count of steps of each variant, starting at variant r mod n.
    `round_sizes` may be a generator that decides when to stop (see `timed_round_sizes`).
    """
    order = list(variants)
    out: dict[V, list[list[T]]] = {v: [] for v in order}
    for r, size in enumerate(round_sizes):
        k = r % len(order)
        for v in order[k:] + order[:k]:
            out[v].append([step(v) for _ in range(size)])
    return out


def fixed_round_sizes(steps: int, per_round: int) -> list[int]:
    """`steps` steps per variant in rounds of `per_round` (the last one shorter if need be)."""
    return [min(per_round, steps - s) for s in range(0, steps, per_round)]


def timed_round_sizes(per_round: int, *, min_steps: int, min_s: float, max_rounds: int) -> Iterator[int]:
    """Rounds of `per_round` steps until both `min_steps` steps per variant and `min_s` seconds have
    passed, and at most `max_rounds` rounds; the clock starts at the first round."""
    start = time.perf_counter()
    for r in range(max_rounds):
        if r * per_round >= min_steps and time.perf_counter() - start >= min_s:
            return
        yield per_round


def quantile(xs: list[float], q: float) -> float:
    """The q-quantile of `xs` by nearest rank (no interpolation: every figure is a measured step)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]
