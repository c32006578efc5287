"""Engine benchmark (`dpscale bench engine`): dpscale vs torch DDP vs an unsynchronized worker.

The measurement is the scaling bench's at one world size (engines built from one seed in the same
ranks, taking turns in rounds of a few steps, a step counted at its slowest rank); this module
only reduces it to what an engine comparison needs: each engine's median step time with its
p10-p90 spread, and for each dpscale engine the median over rounds of its round median divided
by torch DDP's in the same round, with the spread of those ratios.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from dpscale.engine.factory import BENCH_ENGINES, DEFAULT_BENCH_ENGINES, parse_engines
from dpscale.errors import ConfigError
from dpscale.flags import flag_spec
from dpscale.lab.bench import scaling
from dpscale.lab.bench.report import text_table
from dpscale.lab.bench.rounds import quantile
from dpscale.lab.bench.scaling_rank import STEPS_PER_ROUND, split_rounds
from dpscale.lab.recipe import load_recipe


def _names(text: str) -> list[str]:
    return [m for m in text.split(",") if m]


@dataclass(frozen=True, kw_only=True)
class EngineBenchConfig:
    """`dpscale bench engine`: every model at one world size, each engine in alternating rounds."""

    models: list[str] = field(
        default_factory=lambda: ["mlp", "transformer"], metadata=flag_spec(parse=_names)
    )
    """Comma-separated built-in workloads or module:callable specs returning a dpscale.Task."""
    world_size: int = field(default=2, metadata=flag_spec(name="--nproc", deprecated=("--world-size",)))
    """Workers."""
    per_worker_batch: int = 64
    """Samples per worker and step."""
    steps: int = 60
    """Timed steps per engine."""
    engines: list[str] = field(
        default_factory=lambda: list(DEFAULT_BENCH_ENGINES),
        metadata=flag_spec(
            parse=lambda s: parse_engines(s, BENCH_ENGINES),
            help=f"comma-separated: {', '.join(BENCH_ENGINES)} (default: {','.join(DEFAULT_BENCH_ENGINES)})",
        ),
    )
    """Engines to compare."""

    def __post_init__(self) -> None:
        for m in self.models:
            load_recipe(m, "--models", check=True)  # unknown or broken ones fail before anything starts
        parse_engines(",".join(self.engines), BENCH_ENGINES)
        for flag, value in (
            ("--nproc", self.world_size),
            ("--per-worker-batch", self.per_worker_batch),
            ("--steps", self.steps),
        ):
            if value < 1:
                raise ConfigError(f"{flag} must be >= 1, got {value}")


@dataclass
class EngineFigures:
    engine: str
    transport: str
    step_ms_median: float
    step_ms_p10: float
    step_ms_p90: float


@dataclass
class EngineBenchResult:
    model: str
    world_size: int
    per_worker_batch: int
    threads_per_worker: int
    steps: int
    steps_per_round: int
    engines: list[EngineFigures]
    # per dpscale engine: [median, p10, p90] over rounds of (its round median / torch's round median)
    ratios_vs_torch: dict[str, list[float]]

    def to_dict(self) -> dict:
        return asdict(self)


def run(
    model: str = "mlp",
    world_size: int = 2,
    per_worker_batch: int = 64,
    engines: list[str] | None = None,
    steps: int = 60,
) -> tuple[EngineBenchResult, scaling.ScalingResult]:
    """The engine figures, and the scaling bench's result they come from (for its report)."""
    config = scaling.ScalingConfig(
        model=model,
        world_sizes=[world_size],
        per_worker_batch=per_worker_batch,
        engines=list(engines or DEFAULT_BENCH_ENGINES),
        steps=steps,
    )
    result = scaling.run(config)
    return summarize(result), result


def summarize(result: scaling.ScalingResult) -> EngineBenchResult:
    config = result.config
    (world_size,) = config.world_sizes
    # a step's time is its slowest rank's: that is what the next collective waits for
    slowest = {r.engine: [max(ranks) for ranks in r.step_ms] for r in result.runs}
    transport = {r.engine: r.transport for r in result.runs}
    figures = [
        EngineFigures(e, transport[e], statistics.median(t), quantile(t, 0.1), quantile(t, 0.9))
        for e, t in slowest.items()
    ]
    ratios = {}
    if "torch" in slowest:
        torch_rounds = split_rounds(slowest["torch"])
        for e in (e for e in slowest if e.startswith("dpscale")):
            per_round = [
                statistics.median(a) / statistics.median(b)
                for a, b in zip(split_rounds(slowest[e]), torch_rounds, strict=True)
            ]
            ratios[e] = [
                statistics.median(per_round),
                quantile(per_round, 0.1),
                quantile(per_round, 0.9),
            ]
    return EngineBenchResult(
        config.model,
        world_size,
        config.batches(world_size)[0],
        config.threads_per_worker,
        config.steps,
        STEPS_PER_ROUND,
        figures,
        ratios,
    )


_COLUMNS = ("engine", "transport", "step_ms_median", "step_ms_p10", "step_ms_p90")
_HEADERS = {"step_ms_median": "median ms", "step_ms_p10": "p10 ms", "step_ms_p90": "p90 ms"}
_FORMATS = {c: (lambda v: f"{v:.2f}") for c in _COLUMNS[2:]}


def format_result(res: EngineBenchResult) -> str:
    head = (
        f"model={res.model} world_size={res.world_size} per_worker_batch={res.per_worker_batch} "
        f"threads/worker={res.threads_per_worker} steps={res.steps} "
        f"(alternating rounds of {res.steps_per_round})"
    )
    table = text_table([asdict(f) for f in res.engines], _COLUMNS, _FORMATS, _HEADERS)
    ratios = [
        f"{e}/torch step-time ratio: {med:.3f} (p10 {p10:.3f}, p90 {p90:.3f} over rounds)"
        for e, (med, p10, p90) in res.ratios_vs_torch.items()
    ]
    return "\n".join([head, table, *ratios])
