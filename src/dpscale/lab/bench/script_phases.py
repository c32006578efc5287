"""Where each rank's steps go in `dpscale scale`, which steps are not plain training, and who is slow.

The ranks' records (engine/telemetry.py `StepRecord`, as dicts) come per synchronized step. They
are first merged into optimizer steps (`optimizer_steps`): a script that syncs on every
accumulation micro-step at one worker but once per optimizer step at two (Accelerate) would
otherwise compare a micro-step with a whole step. A step that ran an evaluation or saved a
checkpoint is classified as such (`kind`, `step_kinds`) and kept out of the step-time figures:
it is the script's own periodic work, not noise.

Each rank's phases (telemetry.PHASES, plus `idle_ms`: the wait for the slowest rank's step, since
a step counts at its slowest rank) add up to the counted step. A rank whose compute (its
accumulation micro-steps, forward, backward and optimizer) exceeds the other ranks' median on
most steps is named a straggler, with its excess in ms per step; so is a rank whose data wait
takes a large share of its steps.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from dpscale.engine.telemetry import PHASES

IDLE = "idle_ms"
RANK_PHASES = (*PHASES, IDLE)
COMPUTE = ("micro_steps_ms", "forward_ms", "backward_ms", "optimizer_ms")
# a rank is a straggler when its compute exceeds the others' by this much on most steps
STRAGGLER_MIN_MS = 2.0
STRAGGLER_MIN_SHARE = 0.10  # of the others' compute
DATA_WAIT_SHARE = 0.40  # of the rank's own step: the input pipeline dominates


def _add(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def _merge(group: Sequence[dict]) -> dict:
    """One optimizer step from the synchronized steps it spanned."""
    out = {**group[0], "synced_steps": len(group)}
    for r in group[1:]:
        out["step_ms"] += r["step_ms"]
        out["samples"] += r["samples"]
        out["micro_steps"] += r["micro_steps"]
        out["exposed_comm_ms"] = _add(out["exposed_comm_ms"], r["exposed_comm_ms"])
        for name in (
            "optimizer_steps",
            "evaluations",
            "checkpoints",
            "forward_total_ms",
            "backward_total_ms",
        ):
            out[name] = out.get(name, 0) + r.get(name, 0)
        a, b = out.get("phases"), r.get("phases")
        # a synced step with no optimizer step in it is, seen from the optimizer, an accumulation micro-step
        out["phases"] = None if a is None or b is None else _fold(a, b)
    return out


def _fold(earlier: dict, later: dict) -> dict:
    """The phases of two consecutive synced steps that made one optimizer step: all of the
    earlier one is an accumulation micro-step of the later."""
    return {**later, "micro_steps_ms": sum(earlier.values()) + later["micro_steps_ms"]}


def optimizer_steps(records: Sequence[dict], warmup: int = 0) -> list[dict]:
    """`records[warmup:]` merged into optimizer steps; unchanged where no optimizer step was seen (a
    script whose optimizer is not a torch.optim.Optimizer, or records written before they were
    counted). The warm-up is counted in synced steps, so the window may begin inside an optimizer
    step (Accelerate syncs every micro-step at one worker): one begun within `records[:warmup]` is
    left out, as are synced steps after the last optimizer step (an unfinished optimizer step)."""
    if not any(r.get("optimizer_steps") for r in records):
        return list(records[warmup:])
    out: list[dict] = []
    group: list[dict] = []
    first = 0  # index in `records` of the group's first synced step
    for i, r in enumerate(records):
        if not group:
            first = i
        group.append(r)
        if r.get("optimizer_steps"):
            if first >= warmup:
                out.append(_merge(group) if len(group) > 1 else r)
            group = []
    return out


def synced_per_optimizer_step(steps: Sequence[dict]) -> float:
    """The median number of synchronized backwards (all-reduces) per optimizer step."""
    return statistics.median(s.get("synced_steps", 1) for s in steps) if steps else 1.0


def micro_step_comm_ms(steps: Sequence[dict]) -> float | None:
    """The median exposed communication per optimizer step of its synced micro-steps before the last
    (what no_sync() would save at least); None where no step held more than one synced backward."""
    extra = [
        s["exposed_comm_ms"] - s["phases"]["exposed_comm_ms"]
        for s in steps
        if s.get("synced_steps", 1) > 1 and s.get("phases") and s["exposed_comm_ms"] is not None
    ]
    return statistics.median(extra) if extra else None


def kind(step: dict) -> str | None:
    """'checkpoint' or 'evaluation' for a step that held one, else None (a plain training step)."""
    if step.get("checkpoints"):
        return "checkpoint"
    if step.get("evaluations"):
        return "evaluation"
    return None


def step_kinds(per_rank: Sequence[Sequence[dict]]) -> list[str | None]:
    """Per step (the ranks' steps in lockstep), `kind` where any rank held an evaluation or a
    checkpoint. Where some ranks held one and others did not (nanoGPT evaluates and saves on rank
    0 only), the others went on and waited for it in the next step's all-reduce: that step is of
    the same kind, not a slow training step."""
    kinds: list[str | None] = []
    spill: str | None = None  # what the previous step's lone evaluators hold the others up with
    for held in zip(*(map(kind, steps) for steps in per_rank), strict=False):
        mine = "checkpoint" if "checkpoint" in held else "evaluation" if "evaluation" in held else None
        kinds.append(mine or spill)
        spill = mine if None in held else None
    return kinds


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]


def rank_phases(per_rank: Sequence[Sequence[dict]], counted_ms: Sequence[float]) -> list[dict] | None:
    """Per rank: the median and p90 over steps of each phase (RANK_PHASES) and of their sum's
    difference from the counted step (`sum_error`, a fraction). None where a rank's steps lack phases."""
    if not counted_ms or any(s.get("phases") is None for steps in per_rank for s in steps):
        return None
    out = []
    for rank, steps in enumerate(per_rank):
        rows = [
            {**s["phases"], IDLE: max(0.0, t - s["step_ms"])} for s, t in zip(steps, counted_ms, strict=True)
        ]
        errors = [abs(sum(r.values()) - t) / t for r, t in zip(rows, counted_ms, strict=True) if t > 0]
        out.append(
            {
                "rank": rank,
                "median": {p: statistics.median(r[p] for r in rows) for p in RANK_PHASES},
                "p90": {p: _p90([r[p] for r in rows]) for p in RANK_PHASES},
                "sum_error": max(errors, default=0.0),
            }
        )
    return out


def stragglers(per_rank: Sequence[Sequence[dict]]) -> list[dict]:
    """Ranks that hold the others up: {"rank", "cause": "compute" | "data wait", "excess_ms"}.

    compute: the rank's compute exceeds the median of the other ranks' on at least 80% of the steps,
    by at least STRAGGLER_MIN_MS and STRAGGLER_MIN_SHARE at the median; excess_ms is the median
    excess. data wait: the rank's median data wait is DATA_WAIT_SHARE of its step or more;
    excess_ms is its data wait over the other ranks' median."""
    if len(per_rank) < 2 or any(s.get("phases") is None for steps in per_rank for s in steps):
        return []
    compute = [[sum(s["phases"][p] for p in COMPUTE) for s in steps] for steps in per_rank]
    wait = [[s["phases"]["data_wait_ms"] for s in steps] for steps in per_rank]
    out = []
    for rank in range(len(per_rank)):
        others = [r for r in range(len(per_rank)) if r != rank]
        excess = [
            compute[rank][k] - statistics.median(compute[r][k] for r in others)
            for k in range(len(compute[rank]))
        ]
        typical = statistics.median(statistics.median(compute[r]) for r in others)
        ahead = sum(e > 0 for e in excess) / len(excess)
        if ahead >= 0.8 and statistics.median(excess) >= max(STRAGGLER_MIN_MS, STRAGGLER_MIN_SHARE * typical):
            out.append({"rank": rank, "cause": "compute", "excess_ms": statistics.median(excess)})
        step = statistics.median(s["step_ms"] for s in per_rank[rank])
        own_wait = statistics.median(wait[rank])
        if step > 0 and own_wait / step >= DATA_WAIT_SHARE:
            rest = statistics.median(statistics.median(wait[r]) for r in others)
            out.append(
                {"rank": rank, "cause": "data wait", "excess_ms": own_wait - rest, "share": own_wait / step}
            )
    return out


def lost_points(step_ms: float, excess_ms: float) -> float | None:
    """Efficiency points `excess_ms` of a step of `step_ms` costs (its share of the step)."""
    return 100 * excess_ms / step_ms if step_ms > 0 else None


LOSSES = ("compute growth", "data wait", "exposed communication", "straggler wait", "rest")


def efficiency_lost(
    phases: Sequence[dict],
    base: Sequence[dict],
    named: Sequence[dict],
    *,
    efficiency: float,
    step_ms: float,
    work: float,
) -> dict[str, float]:
    """The efficiency points lost at N (100 x (1 - efficiency)) split into LOSSES; they add up to it.

    Each part is the growth of its phases over the 1-worker run's (scaled by `work`, each rank's
    samples per optimizer step at N over N=1's), as a share of the counted step at N: compute
    growth from the fastest rank (contention slows every rank), data wait from the median rank,
    straggler wait the named compute straggler's excess, exposed communication what the fastest rank
    waited for in its backward and at the end less that straggler wait; the rest is what is left
    (steps' variation, the script's own work)."""
    one = base[0]["median"]
    fastest = min(phases, key=lambda r: sum(r["median"][p] for p in COMPUTE))["median"]
    wait = max((s["excess_ms"] for s in named if s["cause"] == "compute"), default=0.0)
    grown = {
        "compute growth": sum(fastest[p] - work * one[p] for p in COMPUTE),
        "data wait": statistics.median(r["median"]["data_wait_ms"] for r in phases)
        - work * one["data_wait_ms"],
        "exposed communication": fastest["exposed_comm_ms"]
        + fastest[IDLE]
        - work * one["exposed_comm_ms"]
        - wait,
        "straggler wait": wait,
    }
    parts = {k: 100 * v / step_ms for k, v in grown.items()}
    parts["rest"] = 100 * (1 - efficiency) - sum(parts.values())
    return parts
