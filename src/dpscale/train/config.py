"""`TrainConfig`: everything a training run needs, in sections that each validate themselves.

A run names its task (`workload` or `task`), how long it trains and its seed; the rest is in
sections: `data` (the batch and its split), `optim`, `checkpoint`, `engine`, `metrics` and
`adaptive` (the noise scale and the growing batch). Each section checks its own fields when it is
built; `TrainConfig` fills the task's defaults in and checks the rules that join two sections.

The `dpscale train` flags, a `--config` TOML file and `to_dict()` stay flat (`--lr`,
`--checkpoint-dir`): `TrainConfig.from_flat(**fields)` builds the nested config from those names
and `to_dict()` gives them back. The split of the global batch depends on the world size, which is
known only inside the workers, so `resolve_batch(world_size)` derives the micro-batch and
accumulation steps there and says which numbers to change when they do not fit.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import typing
import warnings
from collections.abc import Collection
from dataclasses import dataclass, field, fields, replace
from typing import Any

from dpscale.comm.select import TRANSPORT_NAMES
from dpscale.cores import over_host_cap
from dpscale.data.sampler import TAIL_POLICIES
from dpscale.engine.factory import TRAIN_ENGINES
from dpscale.engine.hooks import COMPRESSIONS
from dpscale.engine.trace import TraceWindow, trace_window
from dpscale.errors import ConfigError
from dpscale.flags import flag_name, flag_spec
from dpscale.train.device import DEVICES, PRECISIONS
from dpscale.workloads import WORKLOADS

OPTIMIZERS = ("sgd", "adam", "adamw")
# numpy's legacy seeding and torch's generators take 32 and 64 bits; each rank seeds with
# seed * 1000 + rank, so 32 bits keep every derived seed in range
MAX_SEED = 2**32 - 1
# a timeout is a bound on a hang, not a wait; a week is "never" for a collective, and
# datetime.timedelta (which the process group takes) overflows near 1e14 s
MAX_COLLECTIVE_TIMEOUT_S = 7 * 24 * 3600.0
WORLD_CHANGES = ("keep-global-batch", "scale-lr")
PROGRESS = ("auto", "bar", "plain", "none")
# defaults for a task that is not a built-in workload (a built-in brings its own)
TASK_DEFAULTS: dict[str, Any] = dict(global_batch=64, lr=0.01, epochs=1, optimizer="sgd")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The global batch, its split over workers and micro-batches, the data order's tail and loading."""

    global_batch: int | None = field(default=None, metadata=flag_spec(parse=lambda s: _global_batch(s)))
    """Samples per optimizer step across all workers (default: the workload's); auto: start at the
    default and grow it with the measured noise scale (see auto_batch)."""
    micro_batch: int | None = None
    """Samples per forward/backward on one worker; give this or accumulation_steps, not both."""
    accumulation_steps: int | None = None
    """Micro-batches accumulated per optimizer step (default 1, or derived from micro_batch)."""
    tail: str = "drop"
    """What to do with the samples after the last full global batch: drop, pad or keep."""
    data_workers: int = 0
    """DataLoader worker processes per training worker (0: load in the training process)."""

    def __post_init__(self) -> None:
        _finite_floats(self)
        for name in ("global_batch", "micro_batch", "accumulation_steps"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.micro_batch is not None and self.accumulation_steps is not None:
            raise ConfigError("micro_batch and accumulation_steps: give one, the other is derived")
        _one_of("tail", self.tail, TAIL_POLICIES)
        if self.data_workers < 0:
            raise ConfigError(f"data_workers must be >= 0, got {self.data_workers}")
        if refusal := over_host_cap("data_workers (processes per training worker)", self.data_workers):
            raise ConfigError(refusal)


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """The optimizer, the learning rate and its schedule, clipping and skipped steps."""

    optimizer: str | None = None
    """sgd (with momentum), adam or adamw (default: the workload's)."""
    lr: float | None = None
    """Learning rate at the reference batch (default: the workload's); 0 keeps the weights where they
    are (a measurement run, e.g. of the gradient noise scale)."""
    momentum: float = 0.9
    """SGD momentum."""
    weight_decay: float = 0.0
    """Decoupled for adamw, L2 for sgd and adam."""
    lr_reference_batch: int | None = None
    """Linear scaling (Goyal et al. 2017): lr is multiplied by global_batch / this; None: no scaling."""
    warmup_steps: int = 0
    """Linear warm-up: from lr to the scaled lr with lr_reference_batch, else from 0 to lr."""
    grad_clip_norm: float | None = None
    """Clip gradients to this global L2 norm; None: no clipping."""
    max_skipped_steps: int = 10
    """Stop the run (exit code 3) when this many steps in a row had a non-finite gradient (0: never)."""

    def __post_init__(self) -> None:
        _finite_floats(self)
        if self.lr_reference_batch is not None:
            _positive("lr_reference_batch", self.lr_reference_batch)
        if self.lr is not None and not (self.lr >= 0 and math.isfinite(self.lr)):
            raise ConfigError(f"lr must be a number >= 0, got {self.lr}")
        if self.optimizer is not None:
            _one_of("optimizer", self.optimizer, OPTIMIZERS)
        _non_negative(self, "warmup_steps", "max_skipped_steps")
        if self.grad_clip_norm is not None and not self.grad_clip_norm > 0:
            raise ConfigError(f"grad_clip_norm must be > 0, got {self.grad_clip_norm}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ConfigError(f"weight_decay must be >= 0, got {self.weight_decay}")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Checkpoints and resuming, also at another world size."""

    dir: str | None = field(default=None, metadata=flag_spec(name="--checkpoint-dir"))
    """Where checkpoints go (one directory per checkpoint); None: no checkpoints."""
    every: int = field(default=0, metadata=flag_spec(name="--checkpoint-every"))
    """Checkpoint every this many steps (0: only at the end) when checkpoint_dir is set."""
    keep: int = field(default=3, metadata=flag_spec(name="--keep-checkpoints"))
    """How many recent checkpoints to keep."""
    resume: bool = False
    """Resume from the newest valid checkpoint in checkpoint_dir (a directory without one, or that
    does not exist yet, starts a fresh run); without it, a checkpoint_dir that holds another run's
    checkpoints is refused, unless start_over."""
    start_over: bool = False
    """Start a new run in a checkpoint_dir that holds another run's checkpoints: they are deleted
    before the first worker starts."""
    run_id: str | None = None
    """The run's identity, written into each of its checkpoints: a resume or restart continues
    only this run's, and pruning deletes only this run's (default: the resumed checkpoint's, or a
    new one; `dpscale train` sets it before the workers start)."""
    world_change: str = "keep-global-batch"
    """When a resume finds another world size: keep-global-batch (change accumulation steps; the
    optimization is unchanged) or scale-lr (keep each worker's batch, so the global batch follows
    the world size, and scale the LR with it by the linear rule, ramped over rescale_warmup_steps)."""
    rescale_warmup_steps: int = 20
    """With world_change=scale-lr: steps over which the LR moves linearly to its rescaled value."""

    def __post_init__(self) -> None:
        _one_of("world_change", self.world_change, WORLD_CHANGES)
        _non_negative(self, "every", "rescale_warmup_steps")
        _positive("keep_checkpoints", self.keep)
        if self.resume and not self.dir:
            raise ConfigError("resume needs checkpoint_dir: say where the checkpoints are")
        if self.start_over and (self.resume or not self.dir):
            raise ConfigError(
                "start_over deletes the checkpoints in checkpoint_dir to begin a new run: it needs "
                "checkpoint_dir, and cannot go with resume (which continues them)"
            )
        if self.run_id is not None and not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.run_id):
            raise ConfigError(f"run_id {self.run_id!r} must be 1 to 64 letters, digits, '_' or '-'")
        if self.every and not self.dir:
            raise ConfigError("checkpoint_every needs checkpoint_dir: say where the checkpoints go")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The engine and its transport, compression, bucket size, timeouts and cross-rank checks."""

    name: str = field(default="dpscale", metadata=flag_spec(name="--engine"))
    """dpscale, or torch to run the same loop on torch's DistributedDataParallel."""
    bucket_cap_mb: float = 25.0
    """Gradient bucket size."""
    transport: str = "auto"
    """dpscale engine's transport: auto, gloo, shm or hierarchical (auto: shm on one host)."""
    compression: str = "none"
    """Gradient compression hook: none, fp16, bf16 or powersgd (rank 2, after 10 plain steps)."""
    collective_timeout_s: float = 300.0
    """A collective still waiting for a peer after this long raises, naming the rank that is missing."""
    drift_check_every: int = 100
    """Every this many steps, all ranks compare parameter fingerprints and stop if they differ (0: never)."""
    check_collectives_steps: int = 1
    """The first this many steps compare each collective's op, size and dtype across ranks (0: never)."""

    def __post_init__(self) -> None:
        _finite_floats(self)
        _one_of("engine", self.name, TRAIN_ENGINES)
        _non_negative(self, "drift_check_every", "check_collectives_steps")
        _one_of("transport", self.transport, TRANSPORT_NAMES)
        _one_of("compression", self.compression, COMPRESSIONS)
        # a healthy collective here takes milliseconds; below a second, a busy host would trip it
        if not 1 <= self.collective_timeout_s <= MAX_COLLECTIVE_TIMEOUT_S:
            raise ConfigError(
                f"collective_timeout_s must be between 1 and {MAX_COLLECTIVE_TIMEOUT_S:.0f} seconds "
                f"(a week), got {self.collective_timeout_s}"
            )
        if self.bucket_cap_mb <= 0:
            raise ConfigError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        # the engine sizes buckets in whole bytes: below one, it refuses them inside every worker
        if int(self.bucket_cap_mb * 2**20) < 1:
            raise ConfigError(
                f"bucket_cap_mb must be at least one byte (1/1048576 MB), got {self.bucket_cap_mb}"
            )
        if self.name == "torch" and self.transport not in ("auto", "gloo", "nccl"):
            raise ConfigError(
                f"transport {self.transport!r} is dpscale's own; engine 'torch' uses the process group "
                "(gloo or nccl): drop transport or use engine 'dpscale'"
            )


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """Progress lines and metrics."""

    dir: str | None = field(default=None, metadata=flag_spec(name="--metrics-dir"))
    """Rank 0 writes metrics.jsonl (and TensorBoard events if installed) here."""
    log_every: int = 0
    """Plain progress line every this many steps (0: about 10 lines per run)."""
    progress: str = "auto"
    """auto (a bar on a terminal, plain lines otherwise), bar, plain or none."""
    trace: str | None = field(default=None, metadata=flag_spec(name="--trace", metavar="DIR"))
    """Each rank writes a Chrome trace of its steps here (rank<r>.trace.json: phases and bucket
    reductions; open in Perfetto)."""
    trace_steps: str | None = field(default=None, metadata=flag_spec(name="--trace-steps", metavar="A:B"))
    """The steps A to B-1 (numbered as in metrics.jsonl) the trace holds (default 10:20 with --trace)."""

    def __post_init__(self) -> None:
        if self.progress not in PROGRESS:
            raise ConfigError(f"progress: unknown {self.progress!r}; choose auto, bar, plain or none")
        _non_negative(self, "log_every")
        trace_window(self.trace, self.trace_steps)

    @property
    def window(self) -> TraceWindow | None:
        """The steps --trace holds (None: no trace)."""
        return trace_window(self.trace, self.trace_steps)


@dataclass(frozen=True, kw_only=True)
class AdaptiveConfig:
    """The gradient noise scale's measurement and the growing batch (global_batch auto) it drives."""

    no_noise_scale: bool = False
    """Do not measure the gradient noise scale (it costs one read of each gradient per measured step)."""
    auto_batch: bool = False
    """Grow the global batch during training (what --global-batch auto sets): the accumulation steps
    double when the noise scale is at least twice the global batch and the step times measured so
    far do not predict the doubled batch slower to the target (halving back when they do), up to
    16x the start, and the learning rate takes AdaScale's gain (train/adaptive/auto_batch.py); needs two
    gradients per step (two workers, or two micro-batches on one)."""
    noise_scale_every: int = 8
    """Measure the gradient noise scale on every this many steps (each measurement reads every
    gradient once more, about 1% of an mlp step at 2 workers; 1 gives the steadiest estimate, 8
    keeps its cost well under 1% of a step)."""

    def __post_init__(self) -> None:
        _positive("noise_scale_every", self.noise_scale_every)
        if self.auto_batch and self.no_noise_scale:
            raise ConfigError(
                "global_batch auto: a growing batch needs the noise scale; drop no_noise_scale or give "
                "a number"
            )


SECTIONS: dict[str, type] = dict(
    data=DataConfig,
    optim=OptimConfig,
    checkpoint=CheckpointConfig,
    engine=EngineConfig,
    metrics=MetricsConfig,
    adaptive=AdaptiveConfig,
)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """A training run: what to train, how long, its seed and devices, and one config per section.

    Build it nested, `TrainConfig(workload="mlp", optim=OptimConfig(lr=0.1))`, or from the flat
    names the flags use, `TrainConfig.from_flat(workload="mlp", lr=0.1)`. Flat keywords given to
    `TrainConfig(...)` itself still work, with a DeprecationWarning, until the next release."""

    workload: str | None = None
    """Built-in workload: digits, synthetic, mlp or transformer (its defaults fill the fields left unset)."""
    task: str | None = None
    """Your own task instead of a workload: module:callable returning a dpscale.Task (module.py in the
    current directory); unset fields take global_batch 64, sgd, lr 0.01, 1 epoch."""
    epochs: int | None = None
    """Passes over the training set (default: the workload's); ignored when max_steps is set."""
    max_steps: int | None = None
    """Stop after this many optimizer steps."""
    seed: int = 0
    """Seeds model init, data order and every rank's RNGs (0 to 2**32 - 1)."""
    device: str = "auto"
    """auto (this worker's GPU if CUDA is available, else CPU), cpu, or cuda (GPU LOCAL_RANK, NCCL)."""
    precision: str = "fp32"
    """fp32, bf16 or fp16: autocast for forward and loss; fp16 adds loss scaling kept in step across ranks."""
    data: DataConfig = field(default_factory=DataConfig)
    """The batch and its split, the data order's tail, loading."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer and the learning rate's schedule."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints and resuming."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The data-parallel engine and its transport."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Progress lines and metrics."""
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    """The gradient noise scale and the growing batch."""

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(
                    f"{name} must be {cls.__name__}(...), got {type(getattr(self, name)).__name__}"
                )
        for name in ("epochs", "max_steps"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        _non_negative(self, "seed")
        if self.seed > MAX_SEED:
            raise ConfigError(f"seed must be at most 2**32 - 1 = {MAX_SEED}, got {self.seed}")
        _one_of("device", self.device, DEVICES)
        _one_of("precision", self.precision, PRECISIONS)
        _fill_task_defaults(self)
        _check_across_sections(self)

    @classmethod
    def from_flat(cls, **flat: Any) -> TrainConfig:
        """The config from the flat names the flags and a --config file use (`lr`, `checkpoint_dir`,
        `global_batch="auto"`), as `to_dict()` writes them; a name that is none: TypeError."""
        return cls(**_nest(flat))

    def to_dict(self) -> dict:
        """The flat fields (the flags' names), in the order they have always been written: the
        launcher's spec.json holds this, and every worker rebuilds its config with `from_dict`."""
        out = {}
        for key, (section, name) in FLAT.items():
            out[key] = getattr(self if section is None else getattr(self, section), name)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        """The config `to_dict()` wrote; names it does not know (from another version) are ignored."""
        return cls.from_flat(**{k: v for k, v in d.items() if k in FLAT})

    @classmethod
    def flat_fields(cls) -> list[tuple[str, dataclasses.Field, type]]:
        """(flat name, field, the dataclass declaring it) per flag, in the flags' order (dpscale.flags)."""
        return _flat_fields()

    def resolve_batch(self, world_size: int) -> tuple[int, int]:
        """(micro_batch, accumulation_steps) for `world_size` workers; ValueError when G does not split."""
        g = self.data.global_batch
        assert g is not None, "__post_init__ fills global_batch in"
        if world_size > g:
            raise ConfigError(
                f"world size {world_size} is larger than global_batch {g}: every worker needs at least "
                f"one sample per step; use a global batch of at least {world_size} or fewer workers"
            )
        if g % world_size:
            raise ConfigError(
                f"global_batch {g} is not divisible by the world size {world_size}; "
                f"use a multiple of {world_size} (e.g. {g - g % world_size or world_size})"
            )
        per_worker = g // world_size
        micro_batch = self.data.micro_batch
        if micro_batch is not None:
            if per_worker % micro_batch:
                raise ConfigError(
                    f"micro_batch {micro_batch} does not divide the {per_worker} samples each of "
                    f"{world_size} workers gets per step (global_batch {g}); choose a divisor of {per_worker}"
                )
            return micro_batch, per_worker // micro_batch
        k = self.data.accumulation_steps or 1
        if per_worker % k:
            raise ConfigError(
                f"accumulation_steps {k} does not divide the {per_worker} samples each of {world_size} "
                f"workers gets per step (global_batch {g}); choose a divisor of {per_worker}"
            )
        return per_worker // k, k


# -- the flat names: flags, --config files, to_dict() -----------------------------------------
# in the order the flags are listed and to_dict() writes them (the order of the flat config this
# replaced, so the launcher's spec, checkpoints and results are written byte for byte as before)
_FLAT_ORDER = (
    "workload", "task", "global_batch", "micro_batch", "accumulation_steps", "epochs", "max_steps",
    "optimizer", "lr", "momentum", "weight_decay", "lr_reference_batch", "warmup_steps", "world_change",
    "rescale_warmup_steps", "grad_clip_norm", "seed", "tail", "checkpoint_dir", "checkpoint_every",
    "keep_checkpoints", "max_skipped_steps", "resume", "start_over", "run_id", "metrics_dir", "log_every",
    "progress", "engine", "bucket_cap_mb", "transport", "compression", "collective_timeout_s",
    "drift_check_every", "check_collectives_steps", "device", "precision", "data_workers", "no_noise_scale",
    "auto_batch", "noise_scale_every", "trace", "trace_steps",
)  # fmt: skip


def flat_key(f: dataclasses.Field) -> str:
    """A field's flat name: its flag's, in snake case (`CheckpointConfig.dir` is `checkpoint_dir`)."""
    return flag_name(f).removeprefix("--").replace("-", "_")


def _flat_table() -> dict[str, tuple[str | None, str]]:
    where: dict[str, tuple[str | None, str]] = {}
    for section, cls in SECTIONS.items():
        where |= {flat_key(f): (section, f.name) for f in fields(cls)}
    where |= {f.name: (None, f.name) for f in fields(TrainConfig) if f.name not in SECTIONS}
    assert sorted(where) == sorted(_FLAT_ORDER), "every field has one flat name, listed in _FLAT_ORDER"
    return {key: where[key] for key in _FLAT_ORDER}


FLAT: dict[str, tuple[str | None, str]] = _flat_table()
"""Flat name -> (section, or None for TrainConfig's own fields; the field's name there)."""


@functools.cache
def _flat_fields() -> list[tuple[str, dataclasses.Field, type]]:
    out = []
    for key, (section, name) in FLAT.items():
        owner = TrainConfig if section is None else SECTIONS[section]
        out.append((key, next(f for f in fields(owner) if f.name == name), owner))
    return out


def _nest(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Constructor keywords with the flat names among them moved into their sections (a section
    given as an object is the base they change); `global_batch="auto"` means the growing batch."""
    out: dict[str, Any] = {}
    by_section: dict[str, dict[str, Any]] = {}
    for key, value in kwargs.items():
        section = FLAT.get(key, (None, key))[0]
        if section is None or (key in SECTIONS and isinstance(value, SECTIONS[key])):
            out[key] = value  # a name that is no field reaches the constructor, whose TypeError names it
        else:
            by_section.setdefault(section, {})[FLAT[key][1]] = value
    if by_section.get("data", {}).get("global_batch") == "auto":  # the flag's or a file's value
        by_section["data"]["global_batch"] = None
        by_section.setdefault("adaptive", {})["auto_batch"] = True
    for section, values in by_section.items():
        base = out.get(section)
        out[section] = SECTIONS[section](**values) if base is None else replace(base, **values)
    return out


_dataclass_init = TrainConfig.__init__


@functools.wraps(_dataclass_init)
def _init(self: TrainConfig, **kwargs: Any) -> None:
    flat = [k for k in kwargs if FLAT.get(k, (None,))[0] and not isinstance(kwargs[k], EngineConfig)]
    if flat:
        section, name = FLAT[flat[0]]
        cls = SECTIONS[str(section)].__name__
        warnings.warn(
            f"TrainConfig({flat[0]}=...): flat keywords are deprecated and go in the next release; use "
            f"TrainConfig.from_flat({flat[0]}=...) or the section, TrainConfig({section}={cls}({name}=...))",
            DeprecationWarning,
            stacklevel=2,
        )
    _dataclass_init(self, **_nest(kwargs))


TrainConfig.__init__ = _init  # type: ignore[method-assign]


# -- validation that joins sections, and the checks every section shares ------------------------


def _fill_task_defaults(cfg: TrainConfig) -> None:
    """The task: a workload or your own, and the defaults that come with it."""
    if cfg.workload is not None and cfg.task is not None:
        raise ConfigError("workload and task: give one (task is your own, workload a built-in)")
    if cfg.workload is not None and cfg.workload not in WORKLOADS:
        raise ConfigError(f"workload: unknown {cfg.workload!r}; choose one of {', '.join(WORKLOADS)}")
    defaults = TASK_DEFAULTS if cfg.workload is None else vars(WORKLOADS[cfg.workload])
    if cfg.data.global_batch is None:
        object.__setattr__(cfg, "data", replace(cfg.data, global_batch=defaults["global_batch"]))
    unset = {name: defaults[name] for name in ("lr", "optimizer") if getattr(cfg.optim, name) is None}
    if unset:
        object.__setattr__(cfg, "optim", replace(cfg.optim, **unset))
    if cfg.epochs is None and cfg.max_steps is None:
        object.__setattr__(cfg, "epochs", defaults["epochs"])


def _check_across_sections(cfg: TrainConfig) -> None:
    """The growing batch (adaptive) needs the dpscale engine and a world change that keeps the batch."""
    if not cfg.adaptive.auto_batch:
        return
    if cfg.engine.name != "dpscale":
        raise ConfigError(
            f"global_batch auto: engine {cfg.engine.name} does not measure the noise scale that drives "
            "it; use engine dpscale or give a number"
        )
    if cfg.checkpoint.world_change == "scale-lr":
        raise ConfigError(
            "global_batch auto keeps the batch it grew to across a world-size change (its rate "
            "follows AdaScale's gain): drop world_change scale-lr or give a number"
        )


def _one_of(name: str, value: object, choices: Collection[str]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}: unknown {value!r}; choose one of {', '.join(choices)}")


def _non_negative(config: object, *names: str) -> None:
    by_name = {f.name: f for f in fields(config)}  # type: ignore[arg-type]  # a section or TrainConfig
    for name in names:
        if getattr(config, name) < 0:
            raise ConfigError(f"{flat_key(by_name[name])} must be >= 0, got {getattr(config, name)}")


def _global_batch(text: str) -> int | str:
    """The --global-batch flag: a number of samples, or auto."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"--global-batch: {text!r} is neither a number of samples nor auto") from None


def _finite_floats(config: object) -> None:
    # nan passes every `<` check and inf most of them, so non-finite numbers are refused first
    hints = typing.get_type_hints(type(config))
    for f in fields(config):  # type: ignore[arg-type]  # a section
        value = getattr(config, f.name)
        if float in typing.get_args(hints[f.name]) + (hints[f.name],) and isinstance(value, float):
            if not math.isfinite(value):
                raise ConfigError(f"{flat_key(f)} must be a finite number, got {value}")


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
