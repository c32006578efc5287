"""Convergence bench (`dpscale bench convergence`): does training reach the same place at any world size?

The same workload is trained for the same number of samples at each world size W with the same
global batch G, seed and data order. Smaller worlds accumulate gradients, k_W = max(W) / W, so every
run takes micro-batches of G / max(W) samples and world_size * accumulation_steps is the same for
all; the sampler hands out the same samples per global batch whatever W and k. Data parallelism is
then the single-process computation it replaces, and the loss curves must agree up to float
rounding. A curve that departs points at a bug (in the reduction, the loss scaling, the sampler).

Gap (`compare_curves`): each curve is smoothed with a centred moving average over about a tenth of
the run (an odd number of steps) and compared with the smallest world size's smoothed curve over
the second half of training (steps floor(steps/2)+1 .. steps):
    max_gap     = max |smooth(L_W) - smooth(L_ref)|
    max_rel_gap = max |smooth(L_W) - smooth(L_ref)| / smooth(L_ref)
and a run is within tolerance when max_rel_gap <= tolerance. A non-finite loss there departs.
`run_from_args` exits with 1 when any world size departs, so the bench can gate a change.

Compression (`--compression fp16|bf16|powersgd`): every world size but the reference trains with
that gradient compression hook, while the reference (the smallest world size) stays uncompressed,
so the gap measures what the compression costs. The config JSON has a "compression" key only
when it is not "none", so reports written before the option re-render unchanged.

JSON (`ConvergenceResult.to_dict()`; the `--json` line is `summary()`, one object per world size
with the keys workload, world_size, accumulation_steps, global_batch, steps, samples, final_loss,
test_accuracy, max_gap, max_rel_gap, within_tolerance):
    {"config": {"workload": str, "world_sizes": [int], "global_batch": int, "samples": int,
                "seed": int, "tolerance": float},
     "reference_world_size": int, "smoothing_window_steps": int, "compared_from_step": int,
     "runs": [{"world_size": int, "accumulation_steps": int, "micro_batch": int, "steps": int,
               "samples": int, "final_loss": float | null, "test_accuracy": float | null,
               "param_sha256": str, "wall_s": float, "samples_per_s": float,
               "samples_seen": [int], "losses": [float | null],
               "max_gap": float | null, "max_rel_gap": float | null, "within_tolerance": bool}, ...]}
Losses are per-step means over the global batch (metrics.jsonl's "loss"); null means non-finite.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dpscale.cores import usable_cores
from dpscale.engine.hooks import COMPRESSIONS
from dpscale.errors import ConfigError
from dpscale.flags import flag_spec, unchecked_config
from dpscale.lab.bench.args import nproc_list_field
from dpscale.lab.multirank import run_ranks
from dpscale.train.config import TrainConfig
from dpscale.train.trainer import Trainer
from dpscale.workloads import WORKLOADS, get_workload

DEFAULT_EPOCHS = 5
DEFAULT_TOLERANCE = 0.05
# A tenth of the run: long enough to average out batch-to-batch noise once two runs' trajectories
# differ (a sustained departure, not one unlucky batch, is what matters), short enough to follow
# the curve's shape. Both curves are smoothed alike, so the smoothing itself cannot open a gap.
SMOOTHING_FRACTION = 0.1
# Relative gaps divide by the reference loss; a floor keeps a loss of exactly 0 from dividing by 0.
_LOSS_FLOOR = 1e-12
SUMMARY_KEYS = (
    "workload world_size accumulation_steps global_batch steps samples final_loss test_accuracy "
    "max_gap max_rel_gap within_tolerance"
).split()


@dataclass(kw_only=True)
class TrainingRunsConfig:
    """What both modes of `bench convergence` share (this config and weak.WeakConfig): which
    workload trains, at which world sizes, from which seed; the --help of either shows these once."""

    workload: str = field(
        default="digits", metadata=flag_spec(help=f"one of {', '.join(WORKLOADS)} (default digits)")
    )
    """A built-in workload."""
    world_sizes: list[int] = nproc_list_field()
    """Comma-separated world sizes N (same-batch: each dividing the largest; weak: 1 among them)."""
    seed: int = 0
    """Model init and data order, the same at every world size."""

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ConfigError(f"--workload: unknown {self.workload!r}; choose one of {', '.join(WORKLOADS)}")
        if self.seed < 0:
            raise ConfigError(f"--seed: must be >= 0, got {self.seed}")


@dataclass(kw_only=True)
class ConvergenceConfig(TrainingRunsConfig):
    global_batch: int | None = None
    """Samples per optimizer step (default: the workload's)."""
    samples: int | None = None
    """Samples to train on (default: 5 epochs of the training set)."""
    tolerance: float = DEFAULT_TOLERANCE
    """Largest relative loss gap (max_rel_gap) that is still ok (0.05 = 5%)."""
    compression: str = field(
        default="none",
        metadata=flag_spec(
            help=f"{', '.join(COMPRESSIONS)}: gradient compression of every world size but the "
            "(uncompressed) reference (default none)"
        ),
    )
    """Gradient compression of the non-reference runs."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.world_sizes:
            raise ConfigError("--nproc: the list is empty; give at least one world size, e.g. 1,2")
        if any(w < 1 for w in self.world_sizes) or len(set(self.world_sizes)) != len(self.world_sizes):
            raise ConfigError(f"--nproc: need distinct values >= 1, got {self.world_sizes}")
        largest = max(self.world_sizes)
        if uneven := [w for w in self.world_sizes if largest % w]:
            divisors = ",".join(str(d) for d in range(1, largest + 1) if largest % d == 0)
            raise ConfigError(
                f"--nproc: {', '.join(map(str, uneven))} does not divide the largest world size "
                f"{largest}, so it cannot take the same micro-batches with whole accumulation steps; "
                f"use divisors of {largest} ({divisors})"
            )
        if self.global_batch is None:
            self.global_batch = get_workload(self.workload).global_batch
        if self.global_batch < 1 or self.global_batch % largest:
            up = max(largest, math.ceil(self.global_batch / largest) * largest)
            raise ConfigError(
                f"--global-batch: {self.global_batch} does not split into {largest} equal micro-batches "
                f"(the largest world size); use a multiple of {largest}, e.g. {up}"
            )
        if self.samples is None:
            train, _ = get_workload(self.workload).build_data(self.seed)
            self.samples = DEFAULT_EPOCHS * len(train)
        if self.samples < 2 * self.global_batch:
            raise ConfigError(
                f"--samples: {self.samples} is fewer than two steps of global batch {self.global_batch}; "
                f"the comparison needs a second half of training: use at least {2 * self.global_batch}"
            )
        if self.compression not in COMPRESSIONS:
            choices = ", ".join(COMPRESSIONS)
            raise ConfigError(f"--compression: unknown {self.compression!r}; choose one of {choices}")
        if not (self.tolerance > 0 and math.isfinite(self.tolerance)):
            raise ConfigError(f"--tolerance: must be a positive fraction (0.05 = 5%), got {self.tolerance}")

    @property
    def steps(self) -> int:
        assert self.samples is not None and self.global_batch is not None  # set by __post_init__
        return self.samples // self.global_batch

    def accumulation_steps(self, world_size: int) -> int:
        return max(self.world_sizes) // world_size


@dataclass(frozen=True)
class CurveGap:
    max_gap: float | None  # largest absolute gap of the smoothed curves in the compared steps
    max_rel_gap: float | None  # the largest gap relative to the reference's smoothed loss
    within_tolerance: bool


@dataclass(frozen=True, kw_only=True)
class ConvergenceRun:
    world_size: int
    accumulation_steps: int
    micro_batch: int
    steps: int
    samples: int  # samples trained on: steps * global_batch
    final_loss: float | None  # last step's loss; None when non-finite
    test_accuracy: float | None  # None for workloads without a test split
    param_sha256: str  # equal hashes: bitwise equal final weights
    wall_s: float  # the whole run: starting the ranks, data, training and evaluation
    samples_per_s: float  # training loop only, as the Trainer measures it
    samples_seen: list[int]
    losses: list[float | None]
    max_gap: float | None
    max_rel_gap: float | None
    within_tolerance: bool

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ConvergenceResult:
    config: ConvergenceConfig
    runs: list[ConvergenceRun]

    @property
    def reference(self) -> ConvergenceRun:
        return min(self.runs, key=lambda r: r.world_size)

    def to_dict(self) -> dict:
        steps, config = self.config.steps, asdict(self.config)
        if config["compression"] == "none":
            del config["compression"]  # see the module docstring
        return {
            "config": config,
            "reference_world_size": self.reference.world_size,
            "smoothing_window_steps": smoothing_window(steps),
            "compared_from_step": compared_from(steps) + 1,
            "runs": [r.to_dict() for r in self.runs],
        }

    @classmethod
    def from_dict(cls, doc: dict) -> ConvergenceResult:
        """Rebuild from `to_dict()` output (report.json's "results"), e.g. to re-render a report."""
        config = unchecked_config(ConvergenceConfig, doc["config"])  # validating would build the data
        return cls(config, [ConvergenceRun(**r) for r in doc["runs"]])

    def summary(self) -> list[dict]:
        """The `--json` line: one object per world size, without the curves."""
        from_config = ("workload", "global_batch")
        return [
            {k: getattr(self.config if k in from_config else r, k) for k in SUMMARY_KEYS} for r in self.runs
        ]


# ---- curves and gaps ----------------------------------------------------------------------------


def smoothing_window(steps: int) -> int:
    """Odd, so that the window is centred on its step."""
    return 2 * int(steps * SMOOTHING_FRACTION / 2) + 1


def compared_from(steps: int) -> int:
    """Index of the first compared step: the second half, where the run's outcome is decided. The
    first half is left out because the loss falls fast there, so a harmless shift of a step or two
    between equivalent runs would show as a large gap."""
    return steps // 2


def _nan(losses: Sequence[float | None]) -> list[float]:
    return [math.nan if v is None else v for v in losses]


def smooth(losses: Sequence[float | None], window: int) -> list[float]:
    """Centred moving average over `window` (odd) steps, narrower at the ends; None counts as NaN.

    Centred rather than trailing so that the smoothed curve lies on the raw one in the plot."""
    v, half = _nan(losses), window // 2
    return [statistics.fmean(v[max(0, i - half) : i + half + 1]) for i in range(len(v))]


def gaps(reference: Sequence[float | None], other: Sequence[float | None], window: int) -> list[tuple]:
    """Per step (|smooth(other) - smooth(reference)|, that / smooth(reference)); NaN where not finite."""
    pairs = zip(smooth(reference, window), smooth(other, window), strict=True)
    return [(abs(c - r), abs(c - r) / max(abs(r), _LOSS_FLOOR)) for r, c in pairs]


def compare_curves(
    reference: Sequence[float | None], other: Sequence[float | None], tolerance: float
) -> CurveGap:
    """The gap of `other`'s loss curve to `reference`'s (same steps), as described in the module doc."""
    if len(reference) != len(other) or not reference:
        raise ConfigError(f"curves need the same, non-zero number of steps: {len(reference)} vs {len(other)}")
    compared = gaps(reference, other, smoothing_window(len(reference)))[compared_from(len(reference)) :]
    if not all(math.isfinite(rel) for _, rel in compared):
        return CurveGap(None, None, False)  # diverged: no number to report, and not "ok"
    max_rel_gap = max(rel for _, rel in compared)
    return CurveGap(max(g for g, _ in compared), max_rel_gap, max_rel_gap <= tolerance)


# ---- running ------------------------------------------------------------------------------------


def _train_rank(rank: int, world_size: int, train_kwargs: dict) -> dict:
    return Trainer(TrainConfig.from_flat(**train_kwargs)).fit().to_dict()


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _train(
    config: ConvergenceConfig, world_size: int, reference: list[float | None] | None
) -> ConvergenceRun:
    """One training run at `world_size`, its curve read from metrics.jsonl and compared with `reference`
    (None: this is the reference)."""
    with tempfile.TemporaryDirectory(prefix="dpscale-convergence-") as metrics_dir:
        train = TrainConfig.from_flat(
            workload=config.workload,
            global_batch=config.global_batch,
            accumulation_steps=config.accumulation_steps(world_size),
            max_steps=config.steps,
            seed=config.seed,
            metrics_dir=metrics_dir,
            progress="none",
            compression="none" if reference is None else config.compression,
        )
        train.resolve_batch(world_size)  # fails here, with its message, rather than in every rank
        cores = usable_cores()
        # The same threads per rank at every world size, so no run gets more compute per sample.
        threads = max(1, cores // max(config.world_sizes))
        # Generous: a big workload on a busy machine must finish; a hang still ends with stacks.
        timeout_s = 300 + 5.0 * config.steps
        t0 = time.perf_counter()
        r = run_ranks(_train_rank, world_size, train.to_dict(), threads=threads, timeout_s=timeout_s)[0]
        wall_s = time.perf_counter() - t0
        curve = [json.loads(line) for line in Path(metrics_dir, "metrics.jsonl").read_text().splitlines()]
    losses = [_finite(s["loss"]) for s in curve]
    gap = compare_curves(losses if reference is None else reference, losses, config.tolerance)
    keys = ("accumulation_steps", "micro_batch", "steps", "test_accuracy", "param_sha256", "samples_per_s")
    return ConvergenceRun(
        world_size=world_size,
        **{k: r[k] for k in keys},
        samples=r["samples_seen"],
        final_loss=_finite(r["final_loss"]),
        wall_s=wall_s,
        samples_seen=[s["samples_seen"] for s in curve],
        losses=losses,
        **asdict(gap),
    )


def run(config: ConvergenceConfig) -> ConvergenceResult:
    """Train once per world size, the smallest (the reference) first, and compare the loss curves."""
    ref = _train(config, min(config.world_sizes), None)
    runs = {ref.world_size: ref} | {
        w: _train(config, w, ref.losses) for w in config.world_sizes if w != ref.world_size
    }
    return ConvergenceResult(config, [runs[w] for w in config.world_sizes])


def verdict(run: ConvergenceRun, reference_world_size: int) -> str:
    if run.world_size == reference_world_size:
        return "reference"
    if run.max_rel_gap is None:
        return "DEPARTS (non-finite loss)"
    return "ok" if run.within_tolerance else "DEPARTS beyond tolerance"
