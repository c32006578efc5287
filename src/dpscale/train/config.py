"""`TrainConfig`: everything a training run needs, validated at construction.

Fields map one to one to `dpscale train` flags. The split of the global batch depends on the
world size, which is known only inside the workers, so `resolve_batch(world_size)` derives the
micro-batch and accumulation steps there and says which numbers to change when they do not fit.
"""

from __future__ import annotations

import math
import re
import typing
from collections.abc import Collection
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from dpscale.comm.select import TRANSPORT_NAMES
from dpscale.data.sampler import TAIL_POLICIES
from dpscale.engine.factory import TRAIN_ENGINES
from dpscale.engine.hooks import COMPRESSIONS
from dpscale.errors import ConfigError
from dpscale.flags import flag_spec
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
# defaults for a task that is not a built-in workload (a built-in brings its own)
TASK_DEFAULTS: dict[str, Any] = dict(global_batch=64, lr=0.01, epochs=1, optimizer="sgd")


@dataclass(kw_only=True)
class TrainConfig:
    workload: str | None = None
    """Built-in workload: digits, synthetic, mlp or transformer (its defaults fill the fields left unset)."""
    task: str | None = None
    """Your own task instead of a workload: module:callable returning a dpscale.Task (module.py in the
    current directory); unset fields take global_batch 64, sgd, lr 0.01, 1 epoch."""
    global_batch: int | None = field(default=None, metadata=flag_spec(parse=lambda s: _global_batch(s)))
    """Samples per optimizer step across all workers (default: the workload's); auto: start at the
    default and grow it with the measured noise scale (see auto_batch)."""
    micro_batch: int | None = None
    """Samples per forward/backward on one worker; give this or accumulation_steps, not both."""
    accumulation_steps: int | None = None
    """Micro-batches accumulated per optimizer step (default 1, or derived from micro_batch)."""
    epochs: int | None = None
    """Passes over the training set (default: the workload's); ignored when max_steps is set."""
    max_steps: int | None = None
    """Stop after this many optimizer steps."""
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
    world_change: str = "keep-global-batch"
    """When a resume finds another world size: keep-global-batch (change accumulation steps; the
    optimization is unchanged) or scale-lr (keep each worker's batch, so the global batch follows
    the world size, and scale the LR with it by the linear rule, ramped over rescale_warmup_steps)."""
    rescale_warmup_steps: int = 20
    """With world_change=scale-lr: steps over which the LR moves linearly to its rescaled value."""
    grad_clip_norm: float | None = None
    """Clip gradients to this global L2 norm; None: no clipping."""
    seed: int = 0
    """Seeds model init, data order and every rank's RNGs (0 to 2**32 - 1)."""
    tail: str = "drop"
    """What to do with the samples after the last full global batch: drop, pad or keep."""
    checkpoint_dir: str | None = None
    """Where checkpoints go (one directory per checkpoint); None: no checkpoints."""
    checkpoint_every: int = 0
    """Checkpoint every this many steps (0: only at the end) when checkpoint_dir is set."""
    keep_checkpoints: int = 3
    """How many recent checkpoints to keep."""
    max_skipped_steps: int = 10
    """Stop the run (exit code 3) when this many steps in a row had a non-finite gradient (0: never)."""
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
    metrics_dir: str | None = None
    """Rank 0 writes metrics.jsonl (and TensorBoard events if installed) here."""
    log_every: int = 0
    """Plain progress line every this many steps (0: about 10 lines per run)."""
    progress: str = "auto"
    """auto (a bar on a terminal, plain lines otherwise), bar, plain or none."""
    engine: str = "dpscale"
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
    device: str = "auto"
    """auto (this worker's GPU if CUDA is available, else CPU), cpu, or cuda (GPU LOCAL_RANK, NCCL)."""
    precision: str = "fp32"
    """fp32, bf16 or fp16: autocast for forward and loss; fp16 adds loss scaling kept in step across ranks."""
    data_workers: int = 0
    """DataLoader worker processes per training worker (0: load in the training process)."""
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
        if self.global_batch == "auto":  # from the flag or a config file: the default batch, grown
            self.global_batch, self.auto_batch = None, True
        _finite_floats(self)
        _fill_task_defaults(self)
        _check_data(self)
        _check_optim(self)
        _check_engine(self)
        _check_metrics(self)
        _check_checkpoint(self)
        _check_adaptive(self)

    def resolve_batch(self, world_size: int) -> tuple[int, int]:
        """(micro_batch, accumulation_steps) for `world_size` workers; ValueError when G does not split."""
        g = self.global_batch
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
        if self.micro_batch is not None:
            if per_worker % self.micro_batch:
                raise ConfigError(
                    f"micro_batch {self.micro_batch} does not divide the {per_worker} samples each of "
                    f"{world_size} workers gets per step (global_batch {g}); choose a divisor of {per_worker}"
                )
            return self.micro_batch, per_worker // self.micro_batch
        k = self.accumulation_steps or 1
        if per_worker % k:
            raise ConfigError(
                f"accumulation_steps {k} does not divide the {per_worker} samples each of {world_size} "
                f"workers gets per step (global_batch {g}); choose a divisor of {per_worker}"
            )
        return per_worker // k, k

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


# -- validation, one section at a time ----------------------------------------------------------
# Each function checks its section's fields alone, except where a rule joins two sections (resume
# needs checkpoint_dir; auto_batch needs the dpscale engine): that rule sits in the later section.


def _fill_task_defaults(cfg: TrainConfig) -> None:
    """The task: a workload or your own, and the defaults that come with it."""
    if cfg.workload is not None and cfg.task is not None:
        raise ConfigError("workload and task: give one (task is your own, workload a built-in)")
    if cfg.workload is not None and cfg.workload not in WORKLOADS:
        raise ConfigError(f"workload: unknown {cfg.workload!r}; choose one of {', '.join(WORKLOADS)}")
    defaults = TASK_DEFAULTS if cfg.workload is None else vars(WORKLOADS[cfg.workload])
    for name in ("global_batch", "lr", "optimizer"):
        if getattr(cfg, name) is None:
            setattr(cfg, name, defaults[name])
    if cfg.epochs is None and cfg.max_steps is None:
        cfg.epochs = defaults["epochs"]


def _check_data(cfg: TrainConfig) -> None:
    """The batch, its split, how long to train, the data order and loading."""
    _positive("global_batch", cfg.global_batch)
    for name in ("micro_batch", "accumulation_steps", "epochs", "max_steps"):
        if getattr(cfg, name) is not None:
            _positive(name, getattr(cfg, name))
    if cfg.micro_batch is not None and cfg.accumulation_steps is not None:
        raise ConfigError("micro_batch and accumulation_steps: give one, the other is derived")
    _one_of("tail", cfg.tail, TAIL_POLICIES)
    _non_negative(cfg, "seed")
    if cfg.seed > MAX_SEED:
        raise ConfigError(f"seed must be at most 2**32 - 1 = {MAX_SEED}, got {cfg.seed}")
    if cfg.data_workers < 0:
        raise ConfigError(f"data_workers must be >= 0, got {cfg.data_workers}")


def _check_optim(cfg: TrainConfig) -> None:
    """The optimizer, the learning rate and its schedule, clipping and skipped steps."""
    if cfg.lr_reference_batch is not None:
        _positive("lr_reference_batch", cfg.lr_reference_batch)
    assert cfg.lr is not None, "_fill_task_defaults sets lr"
    if not (cfg.lr >= 0 and math.isfinite(cfg.lr)):
        raise ConfigError(f"lr must be a number >= 0, got {cfg.lr}")
    _one_of("optimizer", cfg.optimizer, OPTIMIZERS)
    _non_negative(cfg, "warmup_steps", "rescale_warmup_steps", "max_skipped_steps")
    if cfg.grad_clip_norm is not None and not cfg.grad_clip_norm > 0:
        raise ConfigError(f"grad_clip_norm must be > 0, got {cfg.grad_clip_norm}")
    if not 0 <= cfg.momentum < 1:
        raise ConfigError(f"momentum must be in [0, 1), got {cfg.momentum}")
    if cfg.weight_decay < 0:
        raise ConfigError(f"weight_decay must be >= 0, got {cfg.weight_decay}")


def _check_engine(cfg: TrainConfig) -> None:
    """The engine and its transport, compression and timeouts, the device and precision."""
    _one_of("engine", cfg.engine, TRAIN_ENGINES)
    _non_negative(cfg, "drift_check_every", "check_collectives_steps")
    _one_of("transport", cfg.transport, TRANSPORT_NAMES)
    _one_of("compression", cfg.compression, COMPRESSIONS)
    # a healthy collective here takes milliseconds; below a second, a busy host would trip it
    if not 1 <= cfg.collective_timeout_s <= MAX_COLLECTIVE_TIMEOUT_S:
        raise ConfigError(
            f"collective_timeout_s must be between 1 and {MAX_COLLECTIVE_TIMEOUT_S:.0f} seconds "
            f"(a week), got {cfg.collective_timeout_s}"
        )
    if cfg.bucket_cap_mb <= 0:
        raise ConfigError(f"bucket_cap_mb must be > 0, got {cfg.bucket_cap_mb}")
    _one_of("device", cfg.device, DEVICES)
    _one_of("precision", cfg.precision, PRECISIONS)
    if cfg.engine == "torch" and cfg.transport not in ("auto", "gloo", "nccl"):
        raise ConfigError(
            f"transport {cfg.transport!r} is dpscale's own; engine 'torch' uses the process group "
            "(gloo or nccl): drop transport or use engine 'dpscale'"
        )


def _check_metrics(cfg: TrainConfig) -> None:
    """Progress lines and metrics."""
    if cfg.progress not in ("auto", "bar", "plain", "none"):
        raise ConfigError(f"progress: unknown {cfg.progress!r}; choose auto, bar, plain or none")
    _non_negative(cfg, "log_every")


def _check_checkpoint(cfg: TrainConfig) -> None:
    """Checkpoints and resuming, also at another world size."""
    _one_of("world_change", cfg.world_change, WORLD_CHANGES)
    _non_negative(cfg, "checkpoint_every")
    _positive("keep_checkpoints", cfg.keep_checkpoints)
    if cfg.resume and not cfg.checkpoint_dir:
        raise ConfigError("resume needs checkpoint_dir: say where the checkpoints are")
    if cfg.start_over and (cfg.resume or not cfg.checkpoint_dir):
        raise ConfigError(
            "start_over deletes the checkpoints in checkpoint_dir to begin a new run: it needs "
            "checkpoint_dir, and cannot go with resume (which continues them)"
        )
    if cfg.run_id is not None and not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", cfg.run_id):
        raise ConfigError(f"run_id {cfg.run_id!r} must be 1 to 64 letters, digits, '_' or '-'")
    if cfg.checkpoint_every and not cfg.checkpoint_dir:
        raise ConfigError("checkpoint_every needs checkpoint_dir: say where the checkpoints go")


def _check_adaptive(cfg: TrainConfig) -> None:
    """The noise scale's measurement and the growing batch (global_batch auto) it drives."""
    _positive("noise_scale_every", cfg.noise_scale_every)
    if not cfg.auto_batch:
        return
    if cfg.engine != "dpscale":
        raise ConfigError(
            f"global_batch auto: engine {cfg.engine} does not measure the noise scale that drives "
            "it; use engine dpscale or give a number"
        )
    if cfg.no_noise_scale:
        raise ConfigError(
            "global_batch auto: a growing batch needs the noise scale; drop no_noise_scale or give a number"
        )
    if cfg.world_change == "scale-lr":
        raise ConfigError(
            "global_batch auto keeps the batch it grew to across a world-size change (its rate "
            "follows AdaScale's gain): drop world_change scale-lr or give a number"
        )


def _one_of(name: str, value: object, choices: Collection[str]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}: unknown {value!r}; choose one of {', '.join(choices)}")


def _non_negative(cfg: TrainConfig, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name} must be >= 0, got {getattr(cfg, name)}")


def _global_batch(text: str) -> int | str:
    """The --global-batch flag: a number of samples, or auto."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"--global-batch: {text!r} is neither a number of samples nor auto") from None


def _finite_floats(cfg: TrainConfig) -> None:
    # nan passes every `<` check and inf most of them, so non-finite numbers are refused first
    hints = typing.get_type_hints(type(cfg))
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if float in typing.get_args(hints[f.name]) + (hints[f.name],) and isinstance(value, float):
            if not math.isfinite(value):
                raise ConfigError(f"{f.name} must be a finite number, got {value}")


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
