"""`dpscale run` and `scale`: a user's script on N workers, as `torchrun` runs it, through run_child.

The workers are started by torch's elastic agent in this process (agent.py, as for `dpscale
train`): on one host with stores on 127.0.0.1 only (where torchrun's `--standalone` would listen
on every interface), across hosts (`nodes`, the same call on every host) with torchrun's
multi-node rendezvous. The agent sets RANK, LOCAL_RANK, WORLD_SIZE and MASTER_* for each worker;
each is forked from the server that imported torch (fork_start.py) and runs what
`python -u -m dpscale.launch.run_child SCRIPT ARGS` runs (with DPSCALE_WORKER_START=exec, that
command): it installs the stand-in engine and runs the script as a fresh interpreter would
(script_main.py). The workers and their temp files are one job (job.py): whatever ends the
command, they end with it. A signal to the command is passed on to the workers (a script may save
on SIGTERM), which get agent.SHUTDOWN_S before they are killed; the command then says in one line
which signal stopped it and exits with 128 + its number.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from dpscale.engine.factory import RUN_ENGINES
from dpscale.engine.trace import TraceWindow, trace_window, write_traces
from dpscale.errors import ConfigError
from dpscale.flags import flag_spec
from dpscale.launch.agent import AgentSpec, run_agent
from dpscale.launch.engine_try import TRY_ENV
from dpscale.launch.job import job_scope
from dpscale.launch.nodes import Nodes
from dpscale.launch.run_child import (
    BUILT_ENV,
    ENGINE_ENV,
    LAUNCHER_ENV,
    LIMIT_ENV,
    TELEMETRY_ENV,
    TRACE_ENV,
)
from dpscale.launch.script_checks import findings, read_facts
from dpscale.log import get_logger
from dpscale.paths import check_writable_dir

logger = get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """`dpscale run`'s flags (the script and its arguments are positional, not fields)."""

    nproc: int = 1
    """Workers on this host."""
    engine: str = "dpscale"
    """dpscale (default), or torch to keep torch's DDP."""
    trace: str | None = field(default=None, metadata=flag_spec(metavar="DIR"))
    """Write one Chrome trace per rank here (rank<r>.trace.json; Perfetto opens it)."""
    trace_steps: str | None = field(default=None, metadata=flag_spec(metavar="A:B"))
    """The synchronized steps A to B-1 (from 1) the trace holds (default 10:20 with --trace)."""

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ConfigError(f"--nproc must be at least 1, got {self.nproc}")
        if self.engine not in RUN_ENGINES:
            raise ConfigError(f"--engine: unknown {self.engine!r}; choose one of {', '.join(RUN_ENGINES)}")
        trace_window(self.trace, self.trace_steps)
        if self.trace is not None:
            check_writable_dir("--trace", self.trace)

    @property
    def window(self) -> TraceWindow | None:
        return trace_window(self.trace, self.trace_steps)


def check_script(script: str) -> Path:
    path = Path(script)
    if not path.is_file():
        raise ConfigError(f"SCRIPT: {script} is not a file; give the path of your training script")
    return path


def run_script(
    script: str,
    args: list[str],
    *,
    nproc: int,
    engine: str = "dpscale",
    telemetry_dir: str | None = None,
    steps: int | None = None,
    threads: int | None = None,
    log_path: Path | None = None,
    nodes: Nodes | None = None,
    trace: TraceWindow | None = None,
    trace_dir: str | None = None,
    try_fix: str | None = None,
) -> int:
    """Run `script args` on `nproc` workers; 0 when every worker succeeded, 1 when one failed.

    With `telemetry_dir`, each worker writes its step telemetry there as rank<r>.json, and with
    `steps` the run ends cleanly after that many synchronized steps; each rank's facts about the
    script (launch/script_checks.py) go there too, as facts-rank<r>.json, and without
    `telemetry_dir` their findings are logged, one line each, at the end. `threads` sets
    OMP_NUM_THREADS for the workers unless the caller's environment sets it (default 1 with more
    than one worker, as torchrun does). With `log_path` the workers' output goes there instead of
    this terminal. With `nodes`, this host's `nproc` workers join a job of that many hosts. With
    `trace`, the records of those steps carry what a Chrome trace needs (engine/trace.py); with
    `trace_dir` too (and no `telemetry_dir`), the run measures its steps and this host's ranks'
    traces are written there once it ends. `try_fix` (an --try entry, launch/engine_try.py) is
    applied to the script's DDP model.
    """
    RunConfig(nproc=nproc, engine=engine)  # the same checks as the flags get
    check_script(script)
    if threads is None and nproc > 1:
        threads = 1  # torchrun's default: N workers of all cores each would overload the host
    env: dict[str, str | None] = {ENGINE_ENV: engine}
    env[LIMIT_ENV] = None if steps is None else str(steps)
    env[TRACE_ENV] = None if trace is None else str(trace)
    env[TRY_ENV] = try_fix
    env[LAUNCHER_ENV] = str(os.getpid())
    if threads is not None:
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", str(threads))
    # the job's temp dir (launch/job.py), which goes with the job whatever ends it
    with job_scope(), tempfile.TemporaryDirectory(prefix="dpscale-run-built-") as built:
        measured = telemetry_dir
        if trace is not None and trace_dir is not None and measured is None:
            measured = str(Path(built) / "telemetry")
            os.mkdir(measured)
        env[TELEMETRY_ENV] = measured
        env[BUILT_ENV] = built
        code = _run(
            AgentSpec(
                nproc=nproc,
                # -u: the script's prints reach the terminal (or log) as they happen, as under torchrun
                args=("-u", "-m", "dpscale.launch.run_child", script, *args),
                nodes=nodes,
                env=env,
                log_path=log_path,
                forked=True,  # from the server (fork_start.py), as the script's own process (script_main.py)
            )
        )
        synchronized = any(Path(built).glob("built-rank*"))
        facts = read_facts(built)
        if trace_dir is not None and measured is not None and measured != telemetry_dir:
            _write_traces(Path(measured), trace_dir, trace)
    if telemetry_dir is not None:  # `scale` renders them with its report
        for doc in facts:
            (Path(telemetry_dir) / f"facts-rank{doc['rank']}.json").write_text(json.dumps(doc))
    else:
        for line in findings(facts):
            logger.warning(line)
    if code == 0 and telemetry_dir is None and not synchronized and (nproc > 1 or nodes is not None):
        # `scale` says it on its rows; a plain run would otherwise end as if the job were one
        logger.warning(
            "the script built no torch.nn.parallel.DistributedDataParallel model on this host, so its "
            "ranks did not synchronize: each trained alone (wrap the model in DDP to train as one job)"
        )
    return code


def _write_traces(telemetry: Path, trace_dir: str, window: TraceWindow | None) -> None:
    """This host's ranks' traces from what they measured (a rank that failed early left none)."""
    docs = [json.loads(p.read_text()) for p in sorted(telemetry.glob("rank*.json"))]
    if not docs:
        logger.warning("--trace: no rank built a model to measure, so no trace was written")
        return
    paths = write_traces(trace_dir, docs, window)
    if not any(r.get("start_s") is not None for d in docs for r in d["records"]):
        logger.warning(
            "--trace: the run ended before step %s (or timed its steps on a GPU, which traces do not "
            "place yet), so the traces in %s hold no step",
            window,
            trace_dir,
        )
    else:
        logger.info("traces: %s", ", ".join(str(p) for p in paths))


def _run(spec: AgentSpec) -> int:
    """0, or 1 with what failed on stderr (torch's failure summary: which rank, its exit code)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    try:
        run_agent(spec)
    except ChildFailedError as e:
        _error(spec.log_path, f"the script failed:\n{e}")
        return 1
    except RendezvousError as e:  # across hosts: a host lost, the store gone, hosts that never came
        _error(spec.log_path, f"the workers' rendezvous failed: {e}")
        return 1
    return 0


# how the launcher's own error starts in the workers' log, after their output (scale reads it apart)
LOG_ERROR_PREFIX = "dpscale: error: "


def _error(log_path: Path | None, text: str) -> None:
    """The error where the workers' output went: this terminal, or the end of their log."""
    if log_path is None:
        logger.error("%s", text)
        return
    with open(log_path, "a") as log:
        log.write(f"{LOG_ERROR_PREFIX}{text}\n")
