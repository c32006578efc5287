"""`dpscale scale`: how the user's own torchrun script scales, measured from inside the engine.

For each world size and engine the script runs under `dpscale run` with step telemetry
(engine/telemetry.py): every rank records each synchronized step's time (from the step's first
training forward to the next step's), its samples (dim 0 of the DDP module's first tensor input,
over its micro-steps), the exposed communication and the step's phases. A rank without a DDP
model (a script that wraps only when world_size > 1) records the steps of its top-level model,
ended by its optimizer's step() (launch/script_watch.py). Steps are compared per optimizer step,
evaluations and checkpoints apart, each rank's phases and the straggler from script_phases.py.
The run stops itself after warm-up + steps synchronized steps, at the same step on every rank
(launch/run_child.py). A step counts at its slowest rank; samples are summed over ranks. Every
worker gets the same intra-op threads at every world size (cores / largest N), so efficiency
compares like with like.

Across hosts (`--nnodes H --rdzv-endpoint HOST:PORT --rdzv-id ID`, torchrun's flags as `dpscale
train` takes them; the same command on every host) each world size N > 1 runs as its own job of
H hosts x N/H workers, with rendezvous id ID-ENGINE-nN, and every host gets every rank's telemetry
(gathered inside the job, launch/run_child.py). The 1-worker baseline that efficiency divides by runs on
one host: the one that serves the rendezvous store; the other hosts skip it and report no efficiency.

JSON (`ScaleResult.to_dict()`, report.json's "results"):
    {"config": {"script": str, "args": [str], "world_sizes": [int], "engines": [str], "steps": int,
                "warmup": int, "threads_per_worker": int, "trace": str | null, "trace_steps": str | null,
                "tries": [str] (--try's fixes),
                "nnodes": int | null, "rdzv_endpoint": str | null, "rdzv_id": str | null,
                "local_addr": str | null, "rdzv_conf": str | null, "node_rank": int | null},
     "points": [{"world_size": int, "engine": str, "transport": str, "steps": int, "step_ms": float,
                 "step_ms_p90": float, "samples_per_step": float, "samples_per_s": float,
                 "step_ms_p10": float | null (null in reports written before it was kept),
                 "efficiency": float | null, "exposed_comm_ms": float | null,
                 "hosts": int | null (distinct hosts of the ranks; null in older reports),
                 "synchronized": bool (false: no rank built a DDP model; no efficiency),
                 "eval_steps": int, "checkpoint_steps": int (timed steps that held one, kept out of
                 the step figures), "synced_per_optimizer_step": float,
                 "phases": [{"rank": int, "median": {PHASE: ms}, "p90": {PHASE: ms}, "sum_error": float}]
                           | null (script_phases.RANK_PHASES),
                 "stragglers": [{"rank": int, "cause": "compute" | "data wait", "excess_ms": float}],
                 "lost_points": {LOSS: points} | null (script_phases.LOSSES),
                 "note": str | null (why the row compares, or not, with N=1),
                 "checks": [str] (the script's problems, one line each: launch/script_checks.py),
                 "learning_rates": [float] (rank 0's lr at its first optimizer steps),
                 "micro_step_comm_ms": float | null (exposed comm of the all-reduces on micro-steps
                                       before the last, per optimizer step; N > 1)}, ...],
                (the fields after "hosts" are absent from reports written before they were kept)
     "profile": {...} | null  (a `dpscale predict --profile` document from dpscale's 1-worker run),
     "tries": [point, ...] (--try: one per fix at the largest N, dpscale's engine, the fix in "note"),
     "try_refusal": str | null (why --try reran nothing),
     "compression_cost": {RATE: ms per MiB} | null (this host's fp16 casts, measured after the
                         N=1 run: predict/compression_cost.py; absent from older reports)}
The diagnosis rendered from them: script_diagnosis.py.
"""

from __future__ import annotations

import json
import re
import statistics
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from dpscale.cores import usable_cores
from dpscale.engine.factory import RUN_ENGINES
from dpscale.engine.trace import trace_window, write_traces
from dpscale.errors import ConfigError
from dpscale.flags import flag_spec
from dpscale.lab.bench import script_phases
from dpscale.lab.bench.args import parse_int_list, parse_name_list
from dpscale.lab.predict import compression_cost
from dpscale.launch.engine_try import parse_try, parse_try_list
from dpscale.launch.hosts import HostFlags, job_nodes
from dpscale.launch.nodes import Nodes
from dpscale.launch.run import LOG_ERROR_PREFIX, run_script
from dpscale.launch.script_checks import findings, read_facts
from dpscale.log import workers
from dpscale.paths import check_writable_dir

JSON_ROW = (
    "world_size",
    "engine",
    "hosts",
    "steps",
    "step_ms",
    "samples_per_s",
    "efficiency",
    "exposed_comm_ms",
)


@dataclass(frozen=True, kw_only=True)
class ScaleConfig(HostFlags):
    script: str
    """Your training script (given after --, not as a flag)."""
    args: list[str] = field(default_factory=list)
    """Its arguments."""
    world_sizes: list[int] = field(
        default_factory=lambda: [1, 2],
        metadata=flag_spec(name="--nproc", parse=lambda s: parse_int_list(s, flag="--nproc", minimum=1)),
    )
    """Comma-separated world sizes."""
    engines: list[str] = field(
        default_factory=lambda: ["dpscale"],
        metadata=flag_spec(
            deprecated=("--engine",),
            parse=lambda s: parse_name_list(s, flag="--engines", choices=list(RUN_ENGINES)),
        ),
    )
    """Comma-separated engines from dpscale, torch."""
    steps: int = 15
    """Timed synchronized steps per run."""
    warmup: int = 3
    """Synchronized steps before timing."""
    threads_per_worker: int = field(
        default=1, metadata=flag_spec(help="intra-op threads (default: cores / largest N)")
    )
    """Intra-op threads per worker."""
    trace: str | None = field(default=None, metadata=flag_spec(metavar="DIR"))
    """Write one Chrome trace per rank here, a folder per world size (open in Perfetto)."""
    trace_steps: str | None = field(default=None, metadata=flag_spec(metavar="A:B"))
    """The synchronized steps A to B-1 (from 1, warm-up included) the trace holds (default 10:20)."""
    tries: list[str] = field(
        default_factory=list,
        metadata=flag_spec(
            name="--try",
            parse=parse_try_list,
            metavar="FIXES",
            help="rerun at the largest N with each engine-side fix: fp16, bucket_cap_mb=MiB, accumulation=K",
        ),
    )
    """Engine-side fixes to measure at the largest world size, one rerun each (launch/engine_try.py)."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"--steps must be at least 1, got {self.steps}")
        window = trace_window(self.trace, self.trace_steps)
        if window is not None:
            if window.start > self.warmup + self.steps:
                raise ConfigError(
                    f"--trace-steps {window}: the runs stop after --warmup + --steps = "
                    f"{self.warmup + self.steps} synchronized steps; trace steps within them"
                )
            assert self.trace is not None
            check_writable_dir("--trace", self.trace)
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0, got {self.warmup}")
        cores = usable_cores()
        if not 1 <= self.threads_per_worker <= 4 * cores:
            raise ConfigError(
                f"--threads-per-worker must be between 1 and {4 * cores} (4 x the {cores} usable "
                f"cores), got {self.threads_per_worker}"
            )
        if not self.world_sizes or min(self.world_sizes) < 1:
            raise ConfigError(f"--nproc: world sizes must be >= 1, got {self.world_sizes}")
        for e in self.engines:
            if e not in RUN_ENGINES:
                raise ConfigError(f"--engines: unknown {e!r}; choose from {', '.join(RUN_ENGINES)}")
        self.check_hosts(self.world_sizes)
        for fix in self.tries:
            parse_try(fix)
        if self.tries and "dpscale" not in self.engines:
            raise ConfigError("--try: the fixes change dpscale's engine; add dpscale to --engines")


@dataclass(frozen=True)
class ScalePoint:
    world_size: int
    engine: str
    transport: str
    steps: int
    step_ms: float  # median over the timed steps of the slowest rank's step
    step_ms_p90: float
    samples_per_step: float  # over all ranks
    samples_per_s: float  # median over the timed steps of the step's samples / its time
    efficiency: float | None  # samples/s at N over N x samples/s at 1 (same engine)
    exposed_comm_ms: float | None  # median over steps, rank 0
    step_ms_p10: float | None = None  # with a default: older reports' points lack it
    hosts: int | None = None  # distinct hosts the ranks ran on (comm.select.host_id)
    # False: no rank built a DDP model, each trained alone (steps from its optimizer, script_watch.py)
    synchronized: bool = True
    eval_steps: int = 0  # timed steps that held an evaluation: kept out of the step figures
    checkpoint_steps: int = 0  # ... a checkpoint
    phases: list[dict] | None = None  # per rank (script_phases.rank_phases); None: not measured
    stragglers: list[dict] = field(default_factory=list)  # script_phases.stragglers
    note: str | None = None  # why this row's figures compare, or do not, with the others
    synced_per_optimizer_step: float = 1.0  # > 1: the script all-reduces on accumulation micro-steps
    lost_points: dict[str, float] | None = None  # script_phases.efficiency_lost: where the loss went
    checks: list[str] = field(default_factory=list)  # the script's problems (launch/script_checks.py)
    learning_rates: list[float] = field(default_factory=list)  # rank 0's lr at its first optimizer steps
    # ms per optimizer step the micro-steps' extra all-reduces left exposed (rank 0; None: not measured)
    micro_step_comm_ms: float | None = None

    @property
    def spread(self) -> float | None:
        """(p90 - p10) / median of the step time."""
        if self.step_ms_p10 is None or not self.step_ms > 0:
            return None
        return (self.step_ms_p90 - self.step_ms_p10) / self.step_ms


@dataclass
class ScaleResult:
    config: ScaleConfig
    points: list[ScalePoint]
    profile: dict | None = None
    # --try: one ScalePoint per fix at the largest N, its fix in `note` (measure_tries)
    tries: list[ScalePoint] = field(default_factory=list)
    try_refusal: str | None = None  # why --try reran nothing
    # this host's fp16 cast rates (CompressionCost.to_dict), for fp16 compression's predicted gain
    compression_cost: dict | None = None

    def to_dict(self) -> dict:
        points = [asdict(p) for p in self.points]
        return {
            "config": asdict(self.config),
            "points": points,
            "profile": self.profile,
            "tries": [asdict(p) for p in self.tries],
            "try_refusal": self.try_refusal,
            "compression_cost": self.compression_cost,
        }

    @classmethod
    def from_dict(cls, doc: dict) -> ScaleResult:
        return cls(
            ScaleConfig(**doc["config"]),
            [ScalePoint(**p) for p in doc["points"]],
            doc.get("profile"),
            [ScalePoint(**p) for p in doc.get("tries", [])],
            doc.get("try_refusal"),
            doc.get("compression_cost"),
        )

    def rows(self) -> list[dict]:
        """The `--json` rows."""
        return [{k: getattr(p, k) for k in JSON_ROW} for p in self.points]


# torch's elastic agent logs a failed worker as a traceback of its own (`E1203 08:33:06.702000 2572
# torch/distributed/elastic/...] ...`): the agent's frames, not the script's
_AGENT_LINE = re.compile(r"^[IWE]\d{4} [\d:.]+ +\d+ torch/distributed/elastic/")
TAIL_LINES = 15


def output_tail(log_text: str) -> str:
    """The end of the workers' output for a ScriptFailed message, with the launcher's error line.

    The launcher appends torch's failure summary (a 15-line box: rank, exit code, no traceback)
    after the workers' output, and the agent logs its own traceback before it; the last lines of
    the log were only those, so the script's own traceback never reached the message."""
    lines = log_text.splitlines()
    end = next((i for i, line in enumerate(lines) if line.startswith(LOG_ERROR_PREFIX)), len(lines))
    output = [line for line in lines[:end] if not _AGENT_LINE.match(line)]
    return "\n".join(output[-TAIL_LINES:] + lines[end : end + 1])


class ScriptFailed(RuntimeError):
    """The script failed or ended early; the message says which run and shows its output's tail."""


def _measure_one(
    config: ScaleConfig, n: int, engine: str, logs: Path, nodes: Nodes | None, try_fix: str | None = None
) -> list[dict]:
    """Every rank's telemetry from one run of the script: on this host, or with `nodes` as one host
    of a job over all of them (n / hosts workers here); with `try_fix` applied to its DDP model."""
    limit = config.warmup + config.steps
    with tempfile.TemporaryDirectory(prefix="dpscale-scale-") as out:
        log = logs / (f"{engine}-{n}.log" if try_fix is None else f"{engine}-{n}-try-{try_fix}.log")
        code = run_script(
            config.script,
            config.args,
            nproc=n if nodes is None else n // nodes.max_nodes,
            nodes=nodes,
            engine=engine,
            telemetry_dir=out,
            steps=limit,
            threads=config.threads_per_worker,
            log_path=log,
            trace=trace_window(config.trace, config.trace_steps),
            try_fix=try_fix,
        )
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
        facts = read_facts(out)
    if config.trace is not None and ranks and try_fix is None:
        # every rank's records are here (gathered in the job): idle behind the slowest rank too
        folder = f"n{n}" if len(config.engines) == 1 else f"n{n}-{engine}"
        write_traces(Path(config.trace) / folder, ranks, trace_window(config.trace, config.trace_steps))
    tail = output_tail(log.read_text(errors="replace"))
    if code != 0:
        advice = "".join(f"\n{line}" for line in findings(facts))
        raise ScriptFailed(
            f"{config.script} with {n} workers ({engine}) exited with code {code}:\n{tail}{advice}"
        )
    facts_by_rank = {f["rank"]: f for f in facts}
    for r in ranks:  # what each rank saw of the script (launch/script_checks.py), beside its steps
        r["script"] = facts_by_rank.get(r["rank"])
    wrapped = sum(r.get("ddp", True) for r in ranks)
    if nodes is not None and not wrapped and 0 < len(ranks) < n:
        # each rank trained, but only a DDP model's group carries the telemetry between hosts
        raise ScriptFailed(
            f"{config.script} with {workers(n)} on {nodes.max_nodes} hosts built no "
            "torch.nn.parallel.DistributedDataParallel model, so its ranks never met and this host "
            f"got the step telemetry of its own {len(ranks)} only: across hosts scale measures a "
            "script that wraps its model in DDP (measure this one on one host)"
            f"\n{tail}"
        )
    if len(ranks) != n or 0 < wrapped < n:
        raise ScriptFailed(
            f"{config.script} with {n} workers ({engine}): {len(ranks)} of {n} ranks trained and {wrapped} "
            "wrapped a model in torch.nn.parallel.DistributedDataParallel; scale measures ranks that all "
            f"train, with DDP on every one or on none\n{tail}"
        )
    done = min(len(r["records"]) for r in ranks)
    if done == 0 and not wrapped:
        raise ScriptFailed(
            f"{config.script} with {workers(n)} built no torch.nn.parallel.DistributedDataParallel model and "
            "stepped no torch.optim optimizer after a training forward: scale finds steps through one of them"
            f"\n{tail}"
        )
    if done < limit:
        raise ConfigError(
            f"{config.script} ran {done} synchronized steps with {workers(n)}, fewer than --warmup "
            f"{config.warmup} + --steps {config.steps}; lower them or let the script run longer"
        )
    return ranks


def _timed_steps(ranks: list[dict], config: ScaleConfig) -> list[list[dict]]:
    """Each rank's timed steps, as optimizer steps (script_phases.optimizer_steps), equally many."""
    end = config.warmup + config.steps
    per_rank = [script_phases.optimizer_steps(r["records"][:end], config.warmup) for r in ranks]
    k = min(len(steps) for steps in per_rank)
    return [steps[:k] for steps in per_rank]


def _point(n: int, engine: str, ranks: list[dict], config: ScaleConfig) -> ScalePoint:
    per_rank = _timed_steps(ranks, config)
    if not per_rank[0]:
        raise ScriptFailed(
            f"{config.script} with {workers(n)}: no optimizer step ended within --steps {config.steps}; "
            "raise --steps"
        )
    kinds = script_phases.step_kinds(per_rank)
    # the script's own evaluations and checkpoints are not noise: their steps are counted apart
    plain = [k for k, what in enumerate(kinds) if what is None] or list(range(len(kinds)))
    counted = [max(rs[k]["step_ms"] for rs in per_rank) for k in range(len(kinds))]
    step_ms = [counted[k] for k in plain]
    samples = [sum(rs[k]["samples"] for rs in per_rank) for k in plain]
    exposed = [
        per_rank[0][k]["exposed_comm_ms"] for k in plain if per_rank[0][k]["exposed_comm_ms"] is not None
    ]
    plain_steps = [[rs[k] for k in plain] for rs in per_rank]
    synchronized = n == 1 or all(r.get("ddp", True) for r in ranks)
    return ScalePoint(
        world_size=n,
        engine=engine,
        transport=ranks[0]["transport"],
        steps=len(step_ms),
        step_ms=statistics.median(step_ms),
        step_ms_p90=statistics.quantiles(step_ms, n=10)[-1] if len(step_ms) > 1 else step_ms[0],
        samples_per_step=statistics.mean(samples),
        # the median step's rate, as the step time shown beside it (and bench scaling's): a mean
        # lets one step held up by the host move the baseline, and with it every efficiency
        samples_per_s=statistics.median(s / (t / 1e3) for s, t in zip(samples, step_ms, strict=True)),
        efficiency=None,
        exposed_comm_ms=statistics.median(exposed) if exposed else None,
        step_ms_p10=statistics.quantiles(step_ms, n=10)[0] if len(step_ms) > 1 else step_ms[0],
        hosts=len({r.get("host") for r in ranks}),
        synchronized=synchronized,
        eval_steps=kinds.count("evaluation"),
        checkpoint_steps=kinds.count("checkpoint"),
        phases=script_phases.rank_phases(plain_steps, step_ms),
        # ranks that never synchronize hold nobody up: their steps do not even line up
        stragglers=script_phases.stragglers(plain_steps) if n > 1 and synchronized else [],
        synced_per_optimizer_step=script_phases.synced_per_optimizer_step(per_rank[0]),
        checks=findings([r["script"] for r in ranks if r.get("script")]),
        learning_rates=list((ranks[0].get("script") or {}).get("lrs", [])),
        # one worker's all-reduces cost next to nothing: the cause is one of N > 1
        micro_step_comm_ms=script_phases.micro_step_comm_ms(plain_steps[0]) if n > 1 else None,
    )


def profile_from(rank0: dict, config: ScaleConfig, point: ScalePoint) -> dict:
    """A `dpscale predict --profile` document from dpscale's one-worker run, per optimizer step:
    forward and backward over all of its micro-steps, the rest (the optimizer, loading data, the
    script's own work) as the optimizer phase. Gradients are assumed ready evenly through backward
    (no per-parameter times). `measure` adds each world size's per-rank samples per optimizer step."""
    steps = script_phases.optimizer_steps(rank0["records"][: config.warmup + config.steps], config.warmup)
    steps = [s for s in steps if script_phases.kind(s) is None] or steps
    if all(
        s.get("phases") for s in steps
    ):  # the phases of each step: micro-steps are forwards and backwards too
        backward = statistics.median(s["backward_total_ms"] - s["phases"]["exposed_comm_ms"] for s in steps)
        work = statistics.median(
            sum(s["phases"][p] for p in ("micro_steps_ms", "forward_ms", "backward_ms")) for s in steps
        )
        forward = max(0.0, work - backward)
    else:  # records written before phases were kept: the synced forward and backward only
        forward = statistics.median(rank0["forward_ms"][config.warmup :] or [0.0])
        backward = statistics.median(
            [r["backward_ms"] for r in steps if r["backward_ms"] is not None] or [0.0]
        )
    return {
        "model": Path(config.script).name,
        "source": "measured",
        "per_worker_batch": round(point.samples_per_step),
        "forward_ms": forward,
        "backward_ms": backward,
        "optimizer_ms": max(0.0, point.step_ms - forward - backward),
        "param_count": rank0["param_count"],
        "param_bytes": rank0["param_bytes"],
        "bytes_per_param": rank0["param_bytes"] / max(1, rank0["param_count"]),
        "params": [],
        "engine_overhead_ms": {},
        "contention": {},
        "sync": [],
        "threads": config.threads_per_worker,
        "steps": config.steps,
        "warmup": config.warmup,
        "system": None,
    }


def _note(p: ScalePoint, base: ScalePoint | None) -> str | None:
    """What a reader must know to compare this row with its engine's 1-worker row."""
    if not p.synchronized:
        return "no rank built a DDP model: the ranks trained alone, without synchronizing; no efficiency"
    notes = []
    if p.transport == "none":  # run_child's record of a rank with no DDP model
        notes.append("no DDP model at 1 worker: steps end at the optimizer's step()")
    if base is not None and p.world_size > 1:
        each, one = p.samples_per_step / p.world_size, base.samples_per_step
        if round(each, 3) != round(one, 3):
            notes.append(f"each rank does {each:g} samples per optimizer step against {one:g} at N=1")
        if p.efficiency is not None and p.efficiency > 1.0:
            why = "smaller per-rank steps can run faster per sample" if each < one else "check the spread"
            notes.append(f"above 100%: {why}")
    held = [
        f"{k} held {what}"
        for k, what in ((p.eval_steps, "an evaluation"), (p.checkpoint_steps, "a checkpoint"))
        if k
    ]
    if held:
        notes.append(f"{' and '.join(held)} (of the timed steps), kept out of the step figures")
    return "; ".join(notes) or None


def _efficiency(p: ScalePoint, base: ScalePoint | None) -> float | None:
    """samples/s over N x the same engine's at N=1, both per optimizer step (script_phases.py)."""
    if base is None or not p.synchronized:
        return None
    return p.samples_per_s / (p.world_size * base.samples_per_s)


def _lost(p: ScalePoint, base: ScalePoint | None) -> dict[str, float] | None:
    if base is None or p.world_size == 1 or p.efficiency is None or not (p.phases and base.phases):
        return None
    work = p.samples_per_step / p.world_size / base.samples_per_step
    return script_phases.efficiency_lost(
        p.phases, base.phases, p.stragglers, efficiency=p.efficiency, step_ms=p.step_ms, work=work
    )


def measure(config: ScaleConfig, logs: Path) -> ScaleResult:
    """Run the script at every world size with every engine (engines alternate within a size).
    Across hosts, N = 1 runs only on the host that serves the rendezvous store."""
    points, profile, nodes = [], None, config.nodes()
    for n in config.world_sizes:
        for engine in config.engines:
            job = job_nodes(nodes, n, engine)
            if job is False:  # the one-worker baseline runs on the store's host only
                continue
            assert job is None or isinstance(job, Nodes)
            ranks = _measure_one(config, n, engine, logs, job)
            points.append(_point(n, engine, ranks, config))
            if n == 1 and engine == "dpscale":
                profile = profile_from(next(r for r in ranks if r["rank"] == 0), config, points[-1])
    base = {p.engine: p for p in points if p.world_size == 1}
    points = [replace(p, efficiency=_efficiency(p, base.get(p.engine))) for p in points]
    points = [
        replace(p, note=_note(p, base.get(p.engine)), lost_points=_lost(p, base.get(p.engine)))
        for p in points
    ]
    if profile is not None:
        # the per-rank work of one optimizer step at each N: nanoGPT divides its accumulation by N
        profile["per_worker_batch_by_world_size"] = {
            str(p.world_size): round(p.samples_per_step / p.world_size)
            for p in points
            if p.engine == "dpscale"
        }
    cast = None
    if profile is not None and max(config.world_sizes) > 1:
        # fp16's predicted gain needs what casting costs here, at the workers' thread count
        cast = compression_cost.measure(config.threads_per_worker).to_dict()
    result = ScaleResult(config, points, profile, compression_cost=cast)
    if config.tries:
        measure_tries(result, logs, nodes)
    return result


def measure_tries(result: ScaleResult, logs: Path, nodes: Nodes | None) -> None:
    """--try: rerun the script at the largest N with dpscale's engine once per fix (in `note`)."""
    config = result.config
    n = max(config.world_sizes)
    at_n = next((p for p in result.points if p.world_size == n and p.engine == "dpscale"), None)
    if at_n is None or not at_n.synchronized or n == 1:
        why = "it built no DDP model" if at_n is not None and n > 1 else "there is no N > 1 on this host"
        result.try_refusal = f"--try reran nothing: {why}, so there is no engine to change at N={n}"
        return
    job = job_nodes(nodes, n, "dpscale")
    assert job is None or isinstance(job, Nodes)
    base = next((p for p in result.points if p.world_size == 1 and p.engine == "dpscale"), None)
    for fix in config.tries:
        point = _point(n, "dpscale", _measure_one(config, n, "dpscale", logs, job, fix), config)
        result.tries.append(replace(point, efficiency=_efficiency(point, base), note=fix))
