"""Weak-scaling convergence (`dpscale bench convergence --mode weak`): time to a target as N grows.

Each worker count N trains with the global batch N x b (b = `batch_per_worker`), as a job that
adds workers usually does, until the target is reached on the eval set or the sample budget is
spent. A bigger batch gives each sample less to do, so N workers need more samples than one to
reach the target; how many more depends on the gradient noise scale (McCandlish et al. 2018), and
the learning-rate rule decides how much of the bigger batch a step uses:

    none      the N=1 rate at every N
    linear    N x the rate (Goyal et al. 2017, "Accurate, Large Minibatch SGD"), best with warm-up
    sqrt      sqrt(N) x the rate (Krizhevsky 2014, "One weird trick"; Hoffer et al. 2017)
    adascale  the rate times AdaScale's gain r_t in [1, N] from the measured noise scale
              (Johnson et al. 2020; train/adaptive/adascale.py), the noise scale measured every step

Per N: steps and samples to target, time to target = steps x the median training step time of
that run (evaluations excluded; its p10 and p90 are kept for the trust checks), statistical
efficiency = samples to target at N=1 / at N (1 = a sample is worth as much as at N=1),
throughput speed-up = (samples/s at N) / (samples/s at N=1), and time-to-target speed-up =
T(1) / T(N), which is their product. The runs are one after the other (not alternating): on a
shared host their step times carry its load.

The eval set is scored every `eval_every_samples` samples, the same sample counts at every N (a
multiple of every N's global batch), so steps to target have the same resolution in samples.
A workload without an eval set (transformer) is judged on its training loss, averaged over the
steps since the last check. JSON: `WeakResult.to_dict()` (report.json's "results"); the `--json`
line is `summary()`, one object per N with SUMMARY_KEYS.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dpscale.cores import usable_cores
from dpscale.engine.factory import TRAIN_ENGINES
from dpscale.errors import ConfigError
from dpscale.flags import flag_spec, unchecked_config
from dpscale.lab.bench.convergence import TrainingRunsConfig
from dpscale.lab.bench.rounds import quantile
from dpscale.lab.multirank import run_ranks
from dpscale.train.adaptive.adascale import AdaScaleGain
from dpscale.train.callbacks import TrainerCallback
from dpscale.train.config import TrainConfig
from dpscale.train.trainer import Trainer
from dpscale.workloads import get_workload

LR_RULES = ("none", "linear", "sqrt", "adascale")
DEFAULT_MAX_EPOCHS = 20
SUMMARY_KEYS = (
    "workload world_size global_batch lr lr_rule reached steps_to_target samples_to_target step_ms "
    "time_to_target_s statistical_efficiency throughput_speedup time_to_target_speedup gns_at_target"
).split()


def parse_target_metric(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    try:
        if not (sep and name.strip()):
            raise ValueError
        number = float(value)
    except ValueError:
        raise ConfigError(f"--target-metric: {text!r} is not NAME=VALUE, e.g. accuracy=0.95") from None
    if not math.isfinite(number):
        raise ConfigError(f"--target-metric: {value!r} is not a finite number")
    return name.strip(), number


@dataclass(kw_only=True)
class WeakConfig(TrainingRunsConfig):
    """`bench convergence --mode weak`: N=1 must be among the world sizes (the reference)."""

    batch_per_worker: int | None = None
    """Samples per worker per step, b: the global batch is N x b (default: the workload's batch)."""
    lr: float | None = None
    """The learning rate at N=1 (default: the workload's)."""
    lr_rule: str = field(default="linear", metadata=flag_spec(help=f"{', '.join(LR_RULES)} (default linear)"))
    """How the learning rate follows N."""
    warmup_steps: int = 0
    """Linear warm-up of the learning rate over this many steps at every N."""
    target_loss: float | None = None
    """The target: eval loss at or below this value."""
    target_metric: str | None = None
    """The target: NAME=VALUE, an eval metric at or above VALUE (e.g. accuracy=0.95)."""
    max_samples: int | None = None
    """Sample budget per N; a run that spends it is 'not reached' (default: 20 epochs)."""
    eval_every_samples: int | None = None
    """Score the eval set every this many samples (default: about a tenth of an epoch)."""
    engine: str = field(
        default="dpscale", metadata=flag_spec(help=f"{', '.join(TRAIN_ENGINES)} (default dpscale)")
    )
    """The data-parallel engine every N trains with."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if 1 not in self.world_sizes or len(set(self.world_sizes)) != len(self.world_sizes):
            raise ConfigError(f"--nproc: need distinct values including 1, got {self.world_sizes}")
        if self.engine not in TRAIN_ENGINES:
            raise ConfigError(
                f"--engine: {self.engine!r} cannot train; choose one of {', '.join(TRAIN_ENGINES)}"
            )
        if self.lr_rule not in LR_RULES:
            raise ConfigError(f"--lr-rule: unknown {self.lr_rule!r}; choose one of {', '.join(LR_RULES)}")
        if self.lr_rule == "adascale" and self.engine != "dpscale":
            raise ConfigError(
                f"--lr-rule: adascale needs the noise scale, which engine {self.engine} does not measure "
                "with several workers; use --engine dpscale or another rule"
            )
        if (self.target_loss is None) == (self.target_metric is None):
            raise ConfigError(
                "--target-loss / --target-metric: give exactly one, e.g. --target-loss 0.2 or "
                "--target-metric accuracy=0.95"
            )
        work = get_workload(self.workload)
        if self.target_metric is not None:
            name, _ = parse_target_metric(self.target_metric)
            if name not in work.metrics:
                known = ", ".join(work.metrics) or "none (use --target-loss)"
                raise ConfigError(f"--target-metric: {self.workload} has no metric {name!r}; it has {known}")
        self.batch_per_worker = self.batch_per_worker or work.global_batch
        self.lr = work.lr if self.lr is None else self.lr
        if self.batch_per_worker < 1:
            raise ConfigError(f"--batch-per-worker: must be >= 1, got {self.batch_per_worker}")
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            raise ConfigError(f"--lr: must be a finite rate >= 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ConfigError(f"--warmup-steps: must be >= 0, got {self.warmup_steps}")
        train_size = len(work.build_data(self.seed)[0])
        largest = self.global_batch(max(self.world_sizes))
        if largest > train_size:
            most = train_size // max(self.world_sizes)
            raise ConfigError(
                f"--batch-per-worker: N={max(self.world_sizes)} makes a global batch of {largest}, more "
                f"than the {train_size} training samples; use at most {most} per worker"
            )
        self.max_samples = self.max_samples or DEFAULT_MAX_EPOCHS * train_size
        every = self.eval_every_samples or max(1, train_size // 10)
        # a multiple of every N's global batch: each N is checked at the same sample counts
        common = math.lcm(*(self.global_batch(n) for n in self.world_sizes))
        self.eval_every_samples = math.ceil(every / common) * common
        if self.max_samples < self.eval_every_samples:
            raise ConfigError(
                f"--max-samples: {self.max_samples} is less than one evaluation interval "
                f"({self.eval_every_samples}); use at least that"
            )

    def global_batch(self, n: int) -> int:
        assert self.batch_per_worker is not None  # set by __post_init__
        return n * self.batch_per_worker

    def lr_at(self, n: int) -> float:
        """The configured rate at N workers (AdaScale's gain comes on top, step by step)."""
        factor = {"linear": n, "sqrt": math.sqrt(n)}.get(self.lr_rule, 1.0)
        assert self.lr is not None  # set by __post_init__
        return self.lr * factor

    @property
    def target(self) -> tuple[str, float]:
        """(name, value): ("loss", v) to go at or below, else a metric to reach or exceed."""
        if self.target_loss is not None:
            return "loss", self.target_loss
        assert self.target_metric is not None  # __post_init__ requires one of the two
        return parse_target_metric(self.target_metric)


@dataclass(frozen=True, kw_only=True)
class WeakRun:
    world_size: int
    global_batch: int
    lr: float
    reached: bool
    steps_to_target: int | None
    samples_to_target: int | None
    step_ms: float  # median training step (evaluations excluded)
    time_to_target_s: float | None  # steps_to_target x step_ms
    samples_per_s: float  # global_batch / step_ms
    gns_at_target: float | None  # the smoothed noise scale (samples) at the last step run
    checks: list[dict]  # per evaluation: step, samples, value (the target's quantity), gns
    steps_run: int
    # p10 and p90 of the same steps; None in reports written before they were kept
    step_ms_p10: float | None = None
    step_ms_p90: float | None = None

    @property
    def spread(self) -> float | None:
        """(p90 - p10) / median of the step time: how much the host's load moved the steps."""
        if self.step_ms_p10 is None or self.step_ms_p90 is None or not self.step_ms > 0:
            return None
        return (self.step_ms_p90 - self.step_ms_p10) / self.step_ms

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class WeakResult:
    config: WeakConfig
    runs: list[WeakRun]
    target_on: str = "eval"  # "train": the workload has no eval set, its training loss was judged

    @property
    def target_text(self) -> str:
        """The target in words, e.g. "eval accuracy >= 0.9" or "train loss <= 2"."""
        name, value = self.config.target
        return f"{self.target_on} {name} {'<=' if name == 'loss' else '>='} {value:g}"

    @property
    def reference(self) -> WeakRun:
        return next(r for r in self.runs if r.world_size == 1)

    def ratios(self, run: WeakRun) -> dict:
        """Statistical efficiency and speed-ups against N=1; None where a run missed the target."""
        ref = self.reference
        both = run.reached and ref.reached
        samples, ref_samples = run.samples_to_target, ref.samples_to_target
        time_s, ref_time_s = run.time_to_target_s, ref.time_to_target_s
        return {
            "statistical_efficiency": ref_samples / samples
            if both and ref_samples is not None and samples is not None
            else None,
            "throughput_speedup": run.samples_per_s / ref.samples_per_s,
            "time_to_target_speedup": ref_time_s / time_s
            if both and ref_time_s is not None and time_s is not None
            else None,
        }

    def to_dict(self) -> dict:
        return {
            "config": asdict(self.config),
            "target": list(self.config.target),
            "target_on": self.target_on,
            "runs": [r.to_dict() | self.ratios(r) for r in self.runs],
        }

    @classmethod
    def from_dict(cls, doc: dict) -> WeakResult:
        """Rebuild from `to_dict()` (report.json's "results") without re-validating (an old report
        need not fit today's rules, and validating would build the data set)."""
        config = unchecked_config(WeakConfig, doc["config"])
        fields = WeakRun.__dataclass_fields__
        runs = [WeakRun(**{k: v for k, v in r.items() if k in fields}) for r in doc["runs"]]
        return cls(config, runs, doc.get("target_on", "eval"))

    def summary(self) -> list[dict]:
        c = self.config
        rows = [
            {"workload": c.workload, "lr_rule": c.lr_rule} | r.to_dict() | self.ratios(r) for r in self.runs
        ]
        return [{k: row[k] for k in SUMMARY_KEYS} for row in rows]


# ---- running ------------------------------------------------------------------------------------


class TargetWatch(TrainerCallback):
    """Scores the target's quantity every `every_samples` samples and ends the run once it is met.

    Evaluation is collective and gives every rank the same numbers, so every rank stops after the
    same step (by lowering `trainer.total_steps`, as if the run had been planned that long)."""

    def __init__(self, *, name: str, value: float, every_samples: int):
        self.name, self.value, self.every = name, value, every_samples
        self.checks: list[dict] = []
        self.eval_s: dict[int, float] = {}  # step -> seconds spent evaluating after it
        self._losses: list[float] = []

    def after_step(self, trainer) -> None:
        self._losses.append(trainer.state.last_loss)
        seen = trainer.state.samples_seen
        if seen % self.every:
            return
        t0 = time.perf_counter()
        scores = trainer.evaluate()
        if scores is None:  # no eval set: the training loss since the last check
            value = statistics.fmean(self._losses) if self.name == "loss" else math.nan
        else:
            value = scores[self.name]
        self._losses = []
        gns = trainer.noise_scale.b_simple
        self.checks.append({"step": trainer.step, "samples": seen, "value": value, "gns": gns})
        self.eval_s[trainer.step] = time.perf_counter() - t0
        met = value <= self.value if self.name == "loss" else value >= self.value
        if met:
            trainer.total_steps = trainer.step


def _train_rank(
    rank: int, world_size: int, train_kwargs: dict, watch: dict, adascale_base: int | None
) -> dict:
    target = TargetWatch(**watch)
    callbacks: list[TrainerCallback] = [target]
    if adascale_base is not None:
        callbacks.append(AdaScaleGain(base_batch=adascale_base))
    Trainer(TrainConfig.from_flat(**train_kwargs), callbacks=callbacks).fit()
    return {"checks": target.checks, "eval_s": target.eval_s}


def _run_one(config: WeakConfig, n: int) -> WeakRun:
    name, value = config.target
    g = config.global_batch(n)
    assert config.max_samples is not None  # set by __post_init__
    adascale = config.lr_rule == "adascale"
    with tempfile.TemporaryDirectory(prefix="dpscale-weak-") as metrics_dir:
        train = TrainConfig.from_flat(
            workload=config.workload,
            global_batch=g,
            accumulation_steps=1,
            lr=config.lr_at(n),
            warmup_steps=config.warmup_steps,
            max_steps=config.max_samples // g,
            engine=config.engine,
            seed=config.seed,
            metrics_dir=metrics_dir,
            progress="none",
            drift_check_every=0,
            noise_scale_every=1 if adascale else 8,
        )
        train.resolve_batch(n)
        assert train.max_steps is not None and train.optim.lr is not None  # both given above
        threads = max(1, usable_cores() // max(config.world_sizes))  # the same compute per rank at every N
        watch = {"name": name, "value": value, "every_samples": config.eval_every_samples}
        out = run_ranks(
            _train_rank,
            n,
            train.to_dict(),
            watch,
            config.batch_per_worker if adascale else None,
            threads=threads,
            timeout_s=300 + 2.0 * train.max_steps,
        )[0]
        steps = [json.loads(line) for line in Path(metrics_dir, "metrics.jsonl").read_text().splitlines()]
    evals = {int(k): v for k, v in out["eval_s"].items()}
    step_times = [s["step_ms"] - 1e3 * evals.get(s["step"], 0.0) for s in steps]
    step_ms = statistics.median(step_times)
    checks = out["checks"]
    last = checks[-1] if checks else None
    reached = last is not None and (last["value"] <= value if name == "loss" else last["value"] >= value)
    to_target = last["step"] if last is not None and reached else None
    return WeakRun(
        world_size=n,
        global_batch=g,
        lr=train.optim.lr,
        reached=reached,
        steps_to_target=to_target,
        samples_to_target=to_target * g if to_target is not None else None,
        step_ms=step_ms,
        time_to_target_s=to_target * step_ms / 1e3 if to_target is not None else None,
        samples_per_s=g / (step_ms / 1e3),
        gns_at_target=steps[-1]["gns"] if steps else None,
        checks=checks,
        steps_run=len(steps),
        step_ms_p10=quantile(step_times, 0.1),
        step_ms_p90=quantile(step_times, 0.9),
    )


def run(config: WeakConfig) -> WeakResult:
    """One training run per N, smallest first, each until the target or the sample budget."""
    _, eval_data = get_workload(config.workload).build_data(config.seed)
    runs = [_run_one(config, n) for n in sorted(config.world_sizes)]
    return WeakResult(config, runs, "eval" if eval_data is not None else "train")
