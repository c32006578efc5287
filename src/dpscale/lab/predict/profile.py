"""A model's one-worker profile: the input of every prediction (`dpscale profile`).

Measured by profiling.py's `measure` (the workload alone on one worker, and with --co-located K
its contention, sync and interference terms); or explicit (below).

Explicit (`explicit`): numbers for a model not at hand; its gradients are then assumed to become
ready evenly through backward.

JSON (`ModelProfile.to_dict()`):
    {"model": str, "source": "measured" | "explicit", "per_worker_batch": int,
     "forward_ms": float, "backward_ms": float, "optimizer_ms": float,
     "param_count": int, "param_bytes": int, "bytes_per_param": float,
     "params": [{"name": str, "numel": int, "nbytes": int, "ready_ms": float}, ...]  (registration order;
               ready_ms from the start of backward; empty for explicit profiles),
     "engine_overhead_ms": {"dpscale": float, "torch": float, "dpscale@shm": float (where shm runs)},
     "contention": {"K": float, ...} (compute slowdown with K workers on the node; may be empty),
     "sync": [{"transport": str, "world_size": int, "call_overhead_ms": float, "free_compute_ms": float,
               "in_step_ms": float, "tight_comm_ms": float, "bucket_bytes": [int, ...]}, ...]
             (in-step sync overheads at world sizes 1 and K with --co-located K, sync.py; may be empty),
     "compute_cv": float | null (step-to-step variation of compute, MAD-based),
     "interference": float | null (interfere.py, with --co-located K), "device": "cpu" | null,
     "input_samples_per_s": float | null (samples/s one process prepares: the task's dataset items
               and collate, as the trainer's loader does per batch),
     "threads": int | null,
     "steps": int | null, "warmup": int | null, "system": {...} | null,
     "per_worker_batch_by_world_size": {"N": int, ...} (optional: each rank's samples per optimizer
               step as `dpscale scale` measured them at each N; a script that divides its accumulation
               by the world size, as nanoGPT, does less per rank at N=2)}
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from dpscale.engine.buckets import MB, assign_buckets
from dpscale.errors import ConfigError
from dpscale.lab.predict.sync import SyncCost
from dpscale.lab.predict.timeline import ReadyBucket
from dpscale.paths import write_no_follow


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """`dpscale profile`'s flags, one per field (checked here, so `measure` and the CLI agree)."""

    model: str
    """A built-in workload (mlp, transformer, digits, synthetic) or module:callable (a dpscale.Task)."""
    per_worker_batch: int = 64
    """Samples per step."""
    steps: int = 20
    """Timed steps; figures are medians."""
    warmup: int = 3
    """Untimed steps first."""
    threads: int = 1
    """Intra-op threads of the worker."""
    co_located: int = 1
    """Also measure K workers computing in lockstep (contention) and the in-step call overhead."""
    out: str | None = None
    """Profile JSON file (default profile-<model>-b<batch>.json)."""
    device: str = "cpu"
    """Where the worker computes: cpu, or cuda (one GPU, times from CUDA events)."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"--device: cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device here (run on the GPU host, or --device cpu)")
        if self.device == "cuda" and self.co_located > 1:
            raise ConfigError("--co-located: measured on CPU workers only; leave it at 1 with --device cuda")
        for flag, value, minimum in (
            ("--per-worker-batch", self.per_worker_batch, 1),
            ("--steps", self.steps, 1),
            ("--warmup", self.warmup, 0),
            ("--threads", self.threads, 1),
            ("--co-located", self.co_located, 1),
        ):
            if value < minimum:
                raise ConfigError(f"{flag}: must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class ParamTiming:
    name: str
    numel: int
    nbytes: int
    ready_ms: float  # median over steps, from the start of backward


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    model: str
    source: str  # "measured" or "explicit"
    per_worker_batch: int
    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    param_count: int
    param_bytes: int
    params: tuple[ParamTiming, ...] = ()  # registration order; empty: gradients spread evenly
    engine_overhead_ms: dict[str, float] = field(default_factory=dict)
    contention: dict[int, float] = field(default_factory=dict)  # workers on the node -> compute slowdown
    sync: tuple[SyncCost, ...] = ()  # in-step sync terms per (transport, world size), sync.py
    # std / mean of one worker's step compute from step to step (robust: 1.4826 x MAD / median);
    # the stragglers term (degrade.py) takes the expected slowest of N workers from it
    compute_cv: float | None = None
    # backward slowdown per ms of communication it hides, measured with --co-located K (interfere.py)
    interference: float | None = None
    # samples/s one process prepares for training (the task's dataset items, collated as the trainer
    # does), measured alone; the input-pipeline term (model.py) takes the node's rate from it
    input_samples_per_s: float | None = None
    device: str | None = None  # where it was measured ("cpu", "cuda"); None for explicit numbers
    threads: int | None = None
    steps: int | None = None
    warmup: int | None = None
    system: dict | None = None
    # each rank's samples per optimizer step at each world size the script ran at (`dpscale scale`);
    # empty: the same per_worker_batch at every N
    per_worker_batch_by_world_size: dict[int, int] = field(default_factory=dict)

    def work_at(self, world_size: int) -> int:
        """Each rank's samples per optimizer step at `world_size`: measured there; else, where every
        measured size kept the global batch, that batch over `world_size`; else per_worker_batch."""
        by_n = self.per_worker_batch_by_world_size
        if world_size in by_n:
            return by_n[world_size]
        totals = {n * b for n, b in by_n.items()}
        if len(totals) == 1 and len(by_n) > 1:
            return max(1, round(totals.pop() / world_size))
        return self.per_worker_batch

    def __post_init__(self) -> None:
        for name in ("forward_ms", "backward_ms", "optimizer_ms"):
            if getattr(self, name) < 0:
                raise ConfigError(f"profile: {name} must be >= 0, got {getattr(self, name)}")
        if self.per_worker_batch < 1:
            raise ConfigError(f"--per-worker-batch: must be >= 1, got {self.per_worker_batch}")

    @property
    def compute_ms(self) -> float:
        """One step with nothing to communicate and no engine."""
        return self.forward_ms + self.backward_ms + self.optimizer_ms

    @property
    def bytes_per_param(self) -> float:
        return self.param_bytes / self.param_count if self.param_count else 0.0

    def sync_cost(self, transport: str, world_size: int) -> SyncCost | None:
        """The calibrated in-step sync terms of `transport` at `world_size`, if measured."""
        return next((c for c in self.sync if (c.transport, c.world_size) == (transport, world_size)), None)

    def buckets(self, bucket_mb: float = 25.0, first_bucket_mb: float = 1.0) -> list[ReadyBucket]:
        """The engine's bucket layout (engine/buckets.py) and when each bucket is ready."""
        if bucket_mb <= 0 or first_bucket_mb <= 0:
            raise ConfigError(
                f"--bucket-mb: bucket sizes must be > 0 MiB, got {bucket_mb} / {first_bucket_mb}"
            )
        if not self.params:
            return _even_buckets(
                self.param_bytes, self.backward_ms, int(bucket_mb * MB), int(first_bucket_mb * MB)
            )
        # meta tensors: assign_buckets needs sizes, dtypes and devices, not memory
        dtype = {1: torch.int8, 2: torch.float16, 4: torch.float32, 8: torch.float64}
        fake = [
            torch.empty(p.numel, dtype=dtype.get(p.nbytes // max(p.numel, 1), torch.float32), device="meta")
            for p in self.params
        ]
        assignment = assign_buckets(fake, int(bucket_mb * MB), int(first_bucket_mb * MB))
        return [
            ReadyBucket(
                k,
                sum(self.params[i].nbytes for i in idxs),
                min(self.backward_ms, max(self.params[i].ready_ms for i in idxs)),
            )
            for k, idxs in enumerate(assignment)
        ]

    def at_batch(self, per_worker_batch: int) -> ModelProfile:
        """This profile at another per-worker batch, forward and backward scaled linearly.

        An approximation: per-operation overheads do not scale with the batch, so small batches
        are slower than this predicts. The optimizer and the engines' overheads do not depend on it.
        """
        if per_worker_batch == self.per_worker_batch:
            return self
        f = per_worker_batch / self.per_worker_batch
        params = tuple(replace(p, ready_ms=p.ready_ms * f) for p in self.params)
        return replace(
            self,
            per_worker_batch=per_worker_batch,
            forward_ms=self.forward_ms * f,
            backward_ms=self.backward_ms * f,
            params=params,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict) -> ModelProfile:
        doc = dict(doc)
        doc["params"] = tuple(ParamTiming(**p) for p in doc.get("params", ()))
        doc["contention"] = {int(k): v for k, v in doc.get("contention", {}).items()}  # JSON keys are str
        by_n = doc.get("per_worker_batch_by_world_size", {})
        doc["per_worker_batch_by_world_size"] = {int(k): int(v) for k, v in by_n.items()}
        doc["sync"] = tuple(
            SyncCost(**{**c, "bucket_bytes": tuple(c["bucket_bytes"])}) for c in doc.get("sync", ())
        )
        doc.pop("bytes_per_param", None)
        return cls(**doc)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        doc = {**self.to_dict(), "bytes_per_param": self.bytes_per_param}
        write_no_follow(path, json.dumps(doc, indent=2, allow_nan=False) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path, *, flag: str = "--profile") -> ModelProfile:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except UnicodeDecodeError:
            raise ConfigError(
                f"{flag}: {path} is not a profile (not UTF-8 text); make one with dpscale profile"
            ) from None
        except RecursionError:
            raise ConfigError(f"{flag}: {path} is not a profile (nested too deeply)") from None
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            text = " ".join(str(e).split())[:200]
            raise ConfigError(
                f"{flag}: cannot read a profile from {path}: {type(e).__name__}: {text}"
            ) from None


def step_to_step_cv(steps_ms: list[float], per_round: int) -> float:
    """The median over rounds of each round's robust CV: variation from one step to the next, not the
    drift of a shared machine's load between rounds (a round lasts about 50 ms)."""
    rounds = [steps_ms[k : k + per_round] for k in range(0, len(steps_ms), per_round)]
    cvs = [robust_cv(r) for r in rounds if len(r) >= 3]
    return statistics.median(cvs) if cvs else robust_cv(steps_ms)


def robust_cv(values: list[float]) -> float:
    """Coefficient of variation from the median absolute deviation (x 1.4826: sigma for a Gaussian),
    so that a burst of other load on a shared machine does not pass for step-to-step variation."""
    med = statistics.median(values)
    if med <= 0 or len(values) < 3:
        return 0.0
    return 1.4826 * statistics.median(abs(v - med) for v in values) / med


def _even_buckets(total_bytes: int, backward_ms: float, cap: int, first_cap: int) -> list[ReadyBucket]:
    buckets: list[ReadyBucket] = []
    done = 0
    while done < total_bytes:
        size = min(first_cap if not buckets else cap, total_bytes - done)
        done += size
        buckets.append(ReadyBucket(len(buckets), size, backward_ms * done / total_bytes))
    return buckets


# beyond any model trained today; past it the numbers overflow the model's bucket layout
MAX_PARAMS = 10**13


def explicit(
    *,
    params: int,
    bytes_per_param: float,
    step_compute_ms: float,
    backward_fraction: float,
    per_worker_batch: int,
    model: str | None = None,
) -> ModelProfile:
    """A profile from numbers: `step_compute_ms` split into backward (`backward_fraction`) and forward;
    named by its size unless `model` is given (reports' titles and headers show the name)."""
    if not 1 <= params <= MAX_PARAMS:
        raise ConfigError(f"--params: must be between 1 and {MAX_PARAMS:.0e} (10 trillion), got {params:.3g}")
    if not bytes_per_param > 0:
        raise ConfigError(f"--bytes-per-param: must be > 0, got {bytes_per_param}")
    if not step_compute_ms > 0:
        raise ConfigError(f"--step-compute-ms: must be > 0, got {step_compute_ms}")
    if not 0 < backward_fraction <= 1:
        raise ConfigError(f"--backward-fraction: must be in (0, 1], got {backward_fraction}")
    return ModelProfile(
        model=model or f"{params / 1e6:.4g} M parameters",
        source="explicit",
        per_worker_batch=per_worker_batch,
        forward_ms=step_compute_ms * (1 - backward_fraction),
        backward_ms=step_compute_ms * backward_fraction,
        optimizer_ms=0.0,
        param_count=params,
        param_bytes=round(params * bytes_per_param),
    )
