"""What recording each step's phases (and a trace) costs: the mlp workload at 2 workers, off and on.

    python benchmarks/phase_cost.py [--rounds 100] [--steps 10] [--json out.json]

Issue #31's bound: phase recording costs <= 1% of an mlp step at 2 workers. Both ranks train the
`mlp` workload (its default global batch, SGD, one intra-op thread per worker) with dpscale's
engine, in rounds of `--steps` steps that rotate over three variants in one run
(lab/bench/rounds.py; the first variant changes every round):

- `off`: `dpscale.DistributedDataParallel`, as a script runs without `dpscale scale`;
- `phases`: the engine with step telemetry (engine/telemetry.py `TelemetryDDP`, what `dpscale
  run`/`scale` put in the script's place) and the marks launch/script_watch.py sets around
  the script's backward and optimizer step (two clock reads and a few attribute writes, inline here);
- `trace`: `phases` with every step inside a trace window (`--trace`): each record also keeps its
  start and every bucket's reduction.

Each variant has its own copy of the model, engine and optimizer (an engine's hooks stay on its
module), built alike. A step is zero_grad + forward + loss + backward + optimizer step. The
figure of record is the median over rounds of (variant / off) mean step time, rank 0, with a 95%
bootstrap interval of that median (resampled rounds) and the rounds' 10th-90th percentiles; the
timing resolves the 1% bound when the interval's upper end is <= 1.01. Rounds interleave the
variants, so a load change hits each alike; 100 rounds of 10 steps (<= 100 ms each) take <= 5.5
minutes. On 2 shared cores a round's ratio varies by several percent, so the interval may stay
wider than 1%: then the load-independent figures below carry the bound.

Beside the timings, two load-independent counts: the Python function calls each variant makes per
step (cProfile over `--steps` steps after the timed rounds; the extra calls are the recording's
whole Python cost) and the recording alone (the telemetry's per-step calls on a stub step, timed
in a tight loop, as a share of the off step). And the engine's one check per forward for a
running torch.profiler (engine/profiler_ranges.py), which every variant pays, timed alone.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import pstats
import random
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from dpscale import DistributedDataParallel
from dpscale.engine.profiler_ranges import profiler_enabled
from dpscale.engine.telemetry import StepTelemetry, TelemetryDDP
from dpscale.engine.trace import MAX_STEPS, TraceWindow
from dpscale.lab.bench.rounds import fixed_round_sizes, quantile, run_rounds
from dpscale.lab.multirank import run_ranks
from dpscale.workloads import WORKLOADS

VARIANTS = ("off", "phases", "trace")


@dataclass
class VariantCost:
    variant: str
    step_ms: float  # median over rounds of the round's mean step, rank 0
    ratio_median: float | None  # this variant / off in the same round, rank 0
    ratio_p10: float | None
    ratio_p90: float | None
    ratio_ci_low: float | None  # 95% bootstrap interval of ratio_median (rounds resampled)
    ratio_ci_high: float | None
    calls_per_step: float  # Python function calls per step (cProfile), rank 0


@dataclass
class PhaseCost:
    workers: int
    per_worker_batch: int
    rounds: int
    steps_per_round: int
    variants: list[VariantCost]
    profiler_check_ns: float  # one profiler_enabled() call, median of batches
    profiler_check_share: float  # of the off step
    recording_us: float  # the telemetry's own work per step, timed alone (stub step)
    recording_share: float  # of the off step


BOOTSTRAP = 2000  # resamples of the rounds for the interval of the median ratio


def bootstrap_median(xs: list[float], *, resamples: int = BOOTSTRAP, seed: int = 0) -> tuple[float, float]:
    """A 95% percentile-bootstrap interval of the median of `xs`."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(resamples))
    return meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]


def _recording_us(steps: int = 20_000) -> float:
    """The telemetry's per-step work on a stub step with no model: a forward's bookkeeping, the
    backward and optimizer marks script_watch.py sets, and reading the record (host clock)."""
    telemetry = StepTelemetry()
    x = (torch.zeros(4, 1),)
    marks_stats = lambda: (None, None)  # noqa: E731 (the engine's stats, not measured here)
    t0 = time.perf_counter()
    for _ in range(steps):
        telemetry.on_forward(x, {}, True, marks_stats)
        h0 = time.perf_counter()
        h1 = time.perf_counter()
        telemetry.marks.forward_total_s += h1 - h0
        telemetry.marks.synced_forward_end = h1
        telemetry.on_forward_timed(h0, h1)
        b0 = time.perf_counter()
        b1 = time.perf_counter()
        telemetry.marks.backward = (b0, b1)
        telemetry.marks.backward_total_s += b1 - b0
        telemetry.marks.optimizer_end = time.perf_counter()
        telemetry.marks.optimizer_steps += 1
    return (time.perf_counter() - t0) / steps * 1e6


def _calls_per_step(step, variants, steps: int) -> dict[str, float]:
    out = {}
    for v in variants:
        prof = cProfile.Profile()
        prof.runcall(lambda v=v: [step(v) for _ in range(steps)])
        out[v] = pstats.Stats(prof).total_calls / steps  # type: ignore[attr-defined]
    return out


def _profiler_check_ns(calls: int = 20_000, batches: int = 5) -> float:
    per_call = []
    for _ in range(batches):
        t = time.perf_counter_ns()
        for _ in range(calls):
            profiler_enabled()
        per_call.append((time.perf_counter_ns() - t) / calls)
    return statistics.median(per_call)


def _rank(rank: int, world: int, rounds: int, steps: int) -> dict:
    torch.set_num_threads(1)
    work = WORKLOADS["mlp"]
    train, _ = work.build_data(0)
    batch = work.global_batch // world
    torch.manual_seed(0)
    base = work.build_model()
    models = {
        "off": DistributedDataParallel(copy.deepcopy(base)),
        "phases": TelemetryDDP(copy.deepcopy(base)),
        "trace": TelemetryDDP(copy.deepcopy(base)),
    }
    models["trace"].telemetry.trace = TraceWindow(1, MAX_STEPS + 1)  # the widest window: every step here
    opts = {v: torch.optim.SGD(m.parameters(), lr=work.lr) for v, m in models.items()}
    g = torch.Generator().manual_seed(rank)

    def step(variant: str) -> float:
        model, opt = models[variant], opts[variant]
        marks = getattr(model, "telemetry", None)
        idx = torch.randint(0, len(train), (batch,), generator=g)
        x, y = train.x[idx], train.y[idx]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = work.loss(model(x), y).mean()
        b0 = time.perf_counter() if marks is not None else 0.0
        loss.backward()
        if marks is not None:  # script_watch.py's timed_backward
            b1 = time.perf_counter()
            marks.marks.backward = (b0, b1)
            marks.marks.backward_total_s += b1 - b0
        opt.step()
        if marks is not None:  # script_watch.py's optimizer post-hook
            marks.marks.optimizer_end = time.perf_counter()
            marks.marks.optimizer_steps += 1
        return (time.perf_counter() - t0) * 1e3

    run_rounds(VARIANTS, step, [steps])  # warm-up: one round each
    timed = run_rounds(VARIANTS, step, fixed_round_sizes(rounds * steps, steps))
    per_round = {v: [statistics.mean(r) for r in timed[v]] for v in VARIANTS}
    calls = _calls_per_step(step, VARIANTS, steps)  # both ranks, so their collectives match
    kept = {v: len(models[v].telemetry.to_dict()["records"]) for v in ("phases", "trace")}
    for m in models.values():
        m.close()
    return dict(
        per_round=per_round,
        batch=batch,
        check_ns=_profiler_check_ns(),
        kept=kept,
        calls=calls,
        recording_us=_recording_us(),
    )


def run(rounds: int, steps: int, workers: int = 2) -> PhaseCost:
    r0 = run_ranks(_rank, workers, rounds, steps, timeout_s=1800)[0]
    off = r0["per_round"]["off"]
    variants = []
    for name, times in r0["per_round"].items():
        ratios = [a / b for a, b in zip(times, off, strict=True)] if name != "off" else None
        low, high = bootstrap_median(ratios) if ratios else (None, None)
        variants.append(
            VariantCost(
                variant=name,
                step_ms=statistics.median(times),
                ratio_median=statistics.median(ratios) if ratios else None,
                ratio_p10=quantile(ratios, 0.1) if ratios else None,
                ratio_p90=quantile(ratios, 0.9) if ratios else None,
                ratio_ci_low=low,
                ratio_ci_high=high,
                calls_per_step=r0["calls"][name],
            )
        )
    off_ms = statistics.median(off)
    return PhaseCost(
        workers=workers,
        per_worker_batch=r0["batch"],
        rounds=rounds,
        steps_per_round=steps,
        variants=variants,
        profiler_check_ns=r0["check_ns"],
        profiler_check_share=r0["check_ns"] / (off_ms * 1e6),
        recording_us=r0["recording_us"],
        recording_share=r0["recording_us"] / (off_ms * 1e3),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--steps", type=int, default=10, help="steps per round per variant")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    if args.rounds < 3 or args.steps < 1:
        parser.error("--rounds must be >= 3 (a p10-p90 needs rounds), --steps >= 1")
    result = run(args.rounds, args.steps)
    print(
        f"mlp, {result.workers} workers x {result.per_worker_batch} samples, {result.rounds} rounds of "
        f"{result.steps_per_round} steps per variant, rotating order"
    )
    print(f"{'variant':<8} {'ms/step':>8} {'calls/step':>10}  ratio to off: median [95% CI] (p10-p90)")
    for v in result.variants:
        ratio = (
            ""
            if v.ratio_median is None
            else f"{v.ratio_median:.4f} [{v.ratio_ci_low:.4f}-{v.ratio_ci_high:.4f}] "
            f"({v.ratio_p10:.4f}-{v.ratio_p90:.4f})"
        )
        print(f"{v.variant:<8} {v.step_ms:8.3f} {v.calls_per_step:10.0f}  {ratio}")
    print(
        f"recording alone (stub step): {result.recording_us:.1f} us per step, "
        f"{result.recording_share:.4%} of the off step"
    )
    print(
        f"profiler check per forward: {result.profiler_check_ns:.0f} ns, "
        f"{result.profiler_check_share:.4%} of the off step (paid by every variant)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(result), f, indent=2)


if __name__ == "__main__":
    main()
