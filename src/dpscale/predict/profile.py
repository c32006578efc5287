"""A model's one-worker profile: the input of every prediction (`dpscale profile`).

Measured (`measure`): the workload runs alone on one worker (one fresh process, one intra-op thread
by default, as the scaling bench's workers). Each step is split into forward (zero_grad, forward,
loss), backward and optimizer (SGD with momentum, as the scaling bench), and a hook on every
parameter stamps when its gradient is ready. Figures are medians over the timed steps after warm-up.
In the same process, on a one-worker process group, the step is also timed wrapped in each engine
(dpscale, torch DDP), alternating with the bare model: the difference is what the engine adds
(copying gradients into buckets, hooks) with nothing to communicate.

Contention and sync terms (`measure(..., co_located=K)`): K workers on this machine step the bare model in
lockstep (a barrier before every step, as synchronized training aligns them, so their
memory-hungry phases coincide), alternating with steps where worker 0 runs alone; the median of
the per-round ratio (slowest worker together / worker 0 alone) is how much slower a worker computes
beside K-1 others. Alternating rounds make the ratio robust to other load on a shared machine.
The same K workers then calibrate the in-step sync terms of each local transport (sync.py): what a
synchronized step adds per all-reduce call and to compute, beyond the all-reduce bench's figures.

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
     "threads": int | null,
     "steps": int | null, "warmup": int | null, "system": {...} | null}
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from ..bench.rounds import run_rounds, timed_round_sizes
from ..engine import DistributedDataParallel
from ..engine.buckets import MB, assign_buckets
from ..engine.registry import DPSCALE_ON_SHM, PROFILE_ENGINES, wrap
from ..errors import ConfigError
from . import interfere
from . import sync as syncs
from .bare import bare_model
from .sync import SyncCost
from .timeline import ReadyBucket

# DPSCALE_ON_SHM: dpscale's engine also timed on a one-worker shm transport (where shm runs): its
# bookkeeping without gloo's thread hand-offs, the base for predicting dpscale on shm (model.py)


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

    def __post_init__(self) -> None:
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
    device: str | None = None  # where it was measured ("cpu"); None for explicit numbers
    threads: int | None = None
    steps: int | None = None
    warmup: int | None = None
    system: dict | None = None

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
        doc["sync"] = tuple(
            SyncCost(**{**c, "bucket_bytes": tuple(c["bucket_bytes"])}) for c in doc.get("sync", ())
        )
        doc.pop("bytes_per_param", None)
        return cls(**doc)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        doc = {**self.to_dict(), "bytes_per_param": self.bytes_per_param}
        path.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path, *, flag: str = "--profile") -> ModelProfile:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError, TypeError, KeyError) as e:
            raise ConfigError(f"{flag}: cannot read a profile from {path}: {e}") from None


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
    buckets, done = [], 0
    while done < total_bytes:
        size = min(first_cap if not buckets else cap, total_bytes - done)
        done += size
        buckets.append(ReadyBucket(len(buckets), size, backward_ms * done / total_bytes))
    return buckets


def explicit(
    *,
    params: int,
    bytes_per_param: float,
    step_compute_ms: float,
    backward_fraction: float,
    per_worker_batch: int,
    model: str = "explicit",
) -> ModelProfile:
    """A profile from numbers: `step_compute_ms` split into backward (`backward_fraction`) and forward."""
    if params < 1:
        raise ConfigError(f"--params: must be >= 1, got {params}")
    if not bytes_per_param > 0:
        raise ConfigError(f"--bytes-per-param: must be > 0, got {bytes_per_param}")
    if not step_compute_ms > 0:
        raise ConfigError(f"--step-compute-ms: must be > 0, got {step_compute_ms}")
    if not 0 < backward_fraction <= 1:
        raise ConfigError(f"--backward-fraction: must be in (0, 1], got {backward_fraction}")
    return ModelProfile(
        model=model,
        source="explicit",
        per_worker_batch=per_worker_batch,
        forward_ms=step_compute_ms * (1 - backward_fraction),
        backward_ms=step_compute_ms * backward_fraction,
        optimizer_ms=0.0,
        param_count=params,
        param_bytes=round(params * bytes_per_param),
    )


# ---- measurement (inside a one-worker process) ------------------------------------------------


# Timed rounds go on past `steps` until they cover this long: a step of half a millisecond needs
# thousands of samples before the median of a per-round difference stops moving (20 steps: 10 ms).
MIN_TIMED_S = 2.0
MAX_ROUNDS = 1000


def _rank_measure(rank: int, world_size: int, model_name: str, batch: int, steps: int, warmup: int) -> dict:
    from ..comm.select import shm_is_safe
    from ..workloads.recipe import load_recipe

    workload = load_recipe(model_name)
    x, y = workload.make_batch(batch, torch.Generator().manual_seed(100))

    def build(engine: str):
        torch.manual_seed(0)  # the same initial weights for every variant
        model = wrap(workload.build_model(), engine)
        return model, torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)

    local, local_opt = build("local")
    named = [(n, p) for n, p in local.named_parameters() if p.requires_grad]
    stamps = [0.0] * len(named)
    for i, (_, p) in enumerate(named):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: stamps.__setitem__(i, time.perf_counter()))
    names = [*PROFILE_ENGINES, *([DPSCALE_ON_SHM] if shm_is_safe() else [])]
    engines = {e: build(e) for e in names}
    phases: list[tuple[float, float, float, list[float]]] = []
    totals: dict[str, list[float]] = {e: [] for e in ("local", *names)}

    def step(model, opt) -> tuple[float, float, float, float]:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = workload.loss(workload.forward(model, x), y) / batch
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        return t0, t1, t2, time.perf_counter()

    variants = {"local": (local, local_opt), **engines}
    for _ in range(warmup):
        for m, o in variants.values():
            step(m, o)
    t0, *_, t3 = step(local, local_opt)
    # Each variant runs a round of several steps in turn: run one step each instead and every step
    # starts with caches the other variants filled, which slows the bare model more than the wrapped
    # ones and hides most of a small model's engine overhead (digits: 0.30 ms per-step alternation
    # vs 0.45 ms in rounds of 10, which is what a training run pays).
    per_round = syncs.steps_per_round((t3 - t0) * 1e3)

    def timed(name: str) -> float:
        t0, t1, t2, t3 = step(*variants[name])
        if name == "local":
            phases.append(
                ((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, [(t - t1) * 1e3 for t in stamps])
            )
        return (t3 - t0) * 1e3

    sizes = timed_round_sizes(per_round, min_steps=steps, min_s=MIN_TIMED_S, max_rounds=MAX_ROUNDS)
    for name, rounds in run_rounds(list(variants), timed, sizes).items():
        # the rounds pair the variants in time: the engines' overheads are medians of per-round
        # differences, which a slow drift or a burst of load shifts far less than it shifts a
        # difference of medians
        totals[name] = [statistics.median(times) for times in rounds]
    for model, _ in engines.values():
        if isinstance(model, DistributedDataParallel):
            model.close()  # the shm transport's segments and the hooks, now rather than at exit
    return {
        "names": [n for n, _ in named],
        "numel": [p.numel() for _, p in named],
        "nbytes": [p.numel() * p.element_size() for _, p in named],
        "phases": phases,
        "totals": totals,
        "per_round": per_round,  # the local variant's phases come in rounds of this many steps
    }


def _rank_contention(
    rank: int, world_size: int, model_name: str, batch: int, steps: int, warmup: int
) -> list:
    import torch.distributed as dist

    bare = bare_model(model_name, batch, rank)

    def step(active: bool) -> float:
        dist.barrier()  # start together, as synchronized training does
        elapsed = 0.0
        if active:
            t0 = time.perf_counter()
            bare.step()
            elapsed = time.perf_counter() - t0
        t = torch.tensor([elapsed], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step counts at its slowest worker
        return t.item() * 1e3

    for _ in range(warmup):
        step(True)
    ratios = []
    for s in range(steps):
        # alternate which comes first, so that drift favours neither
        order = (rank == 0, True) if s % 2 == 0 else (True, rank == 0)
        first, second = step(order[0]), step(order[1])
        alone, together = (first, second) if s % 2 == 0 else (second, first)
        ratios.append(together / alone)
    return ratios


def measure(
    model: str,
    per_worker_batch: int,
    *,
    steps: int = 20,
    warmup: int = 3,
    threads: int = 1,
    co_located: int = 1,
) -> ModelProfile:
    """Profile `model` (a built-in workload or module:callable returning a Task) on one worker in a
    fresh process (see the module docstring)."""
    from ..bench.sysinfo import collect_system_info
    from ..multirank import run_ranks
    from ..workloads.recipe import load_recipe

    ProfileConfig(  # the flags' checks
        model=model,
        per_worker_batch=per_worker_batch,
        steps=steps,
        warmup=warmup,
        threads=threads,
        co_located=co_located,
    )
    load_recipe(model, check=True)  # a broken task fails here with one line, not in the rank
    timeout_s = 120 + 10 * (steps + warmup)
    (raw,) = run_ranks(
        _rank_measure, 1, model, per_worker_batch, steps, warmup, threads=threads, timeout_s=timeout_s
    )
    med = statistics.median
    contention = {}
    if co_located > 1:
        per_rank = run_ranks(
            _rank_contention,
            co_located,
            model,
            per_worker_batch,
            steps,
            warmup,
            threads=threads,
            timeout_s=timeout_s * 2,
        )
        contention[co_located] = med(per_rank[0])
    fwd, bwd, opt, ready = zip(*raw["phases"], strict=True)
    local = raw["totals"]["local"]
    steps_ms = [f + b + o for f, b, o in zip(fwd, bwd, opt, strict=True)]
    params = tuple(
        ParamTiming(name, numel, nbytes, max(0.0, med(r[i] for r in ready)))
        for i, (name, numel, nbytes) in enumerate(zip(raw["names"], raw["numel"], raw["nbytes"], strict=True))
    )
    prof = ModelProfile(
        model=model,
        source="measured",
        per_worker_batch=per_worker_batch,
        forward_ms=med(fwd),
        backward_ms=med(bwd),
        optimizer_ms=med(opt),
        param_count=sum(raw["numel"]),
        param_bytes=sum(raw["nbytes"]),
        params=params,
        # a difference on a noisy machine can come out below zero; an engine adds >= 0
        engine_overhead_ms={
            e: max(0.0, med(t - t0 for t, t0 in zip(raw["totals"][e], local, strict=True)))
            for e in raw["totals"]
            if e != "local"
        },
        contention=contention,
        compute_cv=step_to_step_cv(steps_ms, raw["per_round"]),
        device="cpu",
        threads=threads,
        steps=len(fwd),
        warmup=warmup,
        system=collect_system_info(),
    )
    if co_located > 1:
        # with the engine's default buckets, as the scaling bench trains
        bucket_bytes = [b.nbytes for b in prof.buckets()]
        costs = [
            c
            for n in (1, co_located)  # 1: what the engine overheads above already hold (sync.py)
            for c in syncs.measure(
                model, per_worker_batch, bucket_bytes, n, threads=threads, compute_ms=prof.compute_ms
            )
        ]
        interference = interfere.measure(
            model, per_worker_batch, bucket_bytes, co_located, threads=threads, compute_ms=prof.compute_ms
        )
        prof = replace(prof, sync=tuple(costs), interference=interference)
    return prof
