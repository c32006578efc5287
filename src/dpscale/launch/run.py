"""Start a user's script on N local workers as `torchrun --standalone` does, through `run_child`.

On one host torchrun gets dpscale's loopback rendezvous instead of --standalone (agent.py): its
stores listen on 127.0.0.1 only, as `dpscale train`'s do. The agent and its workers run as one
job (job.py): whatever ends the command, they end with it and leave no temp files; a signal to
the command is passed on to the agent (which passes it to the workers: a script may save on
SIGTERM), which gets `_STOP_S` before it is killed.

Across hosts (`nodes`, the same call on every host) torchrun gets the multi-node flags instead of
--standalone: `dpscale-c10d` (launch/rendezvous.py; the host that carries the endpoint's address
serves the store, as for `dpscale train`), or torch's static rendezvous with --node-rank.

torchrun (torch.distributed.run) does the rendezvous on this host with a port it picks, sets
RANK, LOCAL_RANK, WORLD_SIZE and MASTER_* for each worker and forwards signals; each worker runs
`python -m dpscale.launch.run_child SCRIPT ARGS`, which installs the stand-in engine and runs the script.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from dpscale.engine.factory import RUN_ENGINES
from dpscale.errors import ConfigError
from dpscale.launch import rendezvous
from dpscale.launch.engine_try import TRY_ENV
from dpscale.launch.job import job_scope
from dpscale.launch.nodes import Nodes
from dpscale.launch.process_life import Interrupted, guarded_module
from dpscale.launch.rendezvous import MULTI_HOST_BACKEND
from dpscale.launch.run_child import BUILT_ENV, ENGINE_ENV, LIMIT_ENV, TELEMETRY_ENV
from dpscale.launch.script_checks import findings, read_facts
from dpscale.log import get_logger

logger = get_logger(__name__)

# after a signal, how long the agent may take to stop the workers before it is killed
_STOP_S = 5
# the signals torchrun's agent passes on to its workers; others become SIGTERM
_AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """`dpscale run`'s flags (the script and its arguments are positional, not fields)."""

    nproc: int = 1
    """Workers on this host."""
    engine: str = "dpscale"
    """dpscale (default), or torch to keep torch's DDP."""

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ConfigError(f"--nproc must be at least 1, got {self.nproc}")
        if self.engine not in RUN_ENGINES:
            raise ConfigError(f"--engine: unknown {self.engine!r}; choose one of {', '.join(RUN_ENGINES)}")


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
    try_fix: str | None = None,
) -> int:
    """Run `script args` on `nproc` workers; the exit code torchrun reports (0: every worker succeeded).

    With `telemetry_dir`, each worker writes its step telemetry there as rank<r>.json, and with
    `steps` the run ends cleanly after that many synchronized steps; each rank's facts about the
    script (launch/script_checks.py) go there too, as facts-rank<r>.json, and without
    `telemetry_dir` their findings are logged, one line each, at the end. `threads` sets
    OMP_NUM_THREADS for the workers unless the caller's environment sets it. With `log_path`
    the workers' output goes there instead of this terminal. With `nodes`, this host's `nproc`
    workers join a job of that many hosts. `try_fix` (an --try entry, launch/engine_try.py) is
    applied to the script's DDP model.
    """
    RunConfig(nproc=nproc, engine=engine)  # the same checks as the flags get
    check_script(script)
    # torchrun's agent ends with this process, and its workers with the agent (process_life.py)
    cmd = guarded_module(
        "dpscale.launch.agent",
        *(single_host_args() if nodes is None else torchrun_node_args(nodes)),
        f"--nproc-per-node={nproc}",
        "-m",
        # torchrun's own flags end here: without "--" its parser takes the script's `--nproc` or
        # `--log` for abbreviations of --nproc-per-node or --log-dir, and refuses them as ambiguous
        "--",
        "dpscale.launch.run_child",
        script,
        *args,
    )
    with job_scope() as job:  # the environment below carries the job's marker and temp dir
        job.start_reaper()  # before torchrun starts, also where run_script is the outermost scope
        env = dict(os.environ, **{ENGINE_ENV: engine})
        for name, value in ((TELEMETRY_ENV, telemetry_dir), (LIMIT_ENV, steps), (TRY_ENV, try_fix)):
            env.pop(name, None)
            if value is not None:
                env[name] = str(value)
        if threads is not None:
            env.setdefault("OMP_NUM_THREADS", str(threads))
        with tempfile.TemporaryDirectory(prefix="dpscale-run-built-") as built:
            env[BUILT_ENV] = built
            code = _run(cmd, env, log_path)
            synchronized = any(Path(built).glob("built-rank*"))
            facts = read_facts(built)
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


def _run(cmd: list[str], env: dict[str, str], log_path: Path | None) -> int:
    if log_path is None:
        return _wait_for_agent(subprocess.Popen(cmd, env=env))
    with open(log_path, "w") as log:
        return _wait_for_agent(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))


def _wait_for_agent(agent: subprocess.Popen) -> int:
    """The agent's exit code; on a signal to this process, the agent stops the workers, then goes on."""
    try:
        return agent.wait()
    except Interrupted as e:
        agent.send_signal(e.signum if e.signum in _AGENT_SIGNALS else signal.SIGTERM)
        try:
            agent.wait(_STOP_S)
        except subprocess.TimeoutExpired:
            pass  # the job's reaper kills what is left
        raise
    finally:
        if agent.poll() is None:
            agent.kill()


def single_host_args() -> list[str]:
    """torchrun's flags for a job on this host alone: --standalone, with stores on 127.0.0.1 only."""
    return [
        "--nnodes=1",
        f"--rdzv-backend={rendezvous.BACKEND}",
        f"--rdzv-endpoint={rendezvous.LOOPBACK}:0",
        f"--rdzv-id=dpscale-{uuid.uuid4().hex[:8]}",
    ]


def torchrun_node_args(nodes: Nodes) -> list[str]:
    """torchrun's flags for one host of a multi-host job: what the user named, nothing else."""
    args = [f"--nnodes={nodes.min_nodes}:{nodes.max_nodes}", f"--rdzv-endpoint={nodes.rdzv_endpoint}"]
    args.append(f"--rdzv-id={nodes.rdzv_id}")
    if nodes.local_addr is not None:
        args.append(f"--local-addr={nodes.local_addr}")
    if nodes.node_rank is not None:  # torch's static rendezvous: the host of rank 0 serves the store
        args += ["--rdzv-backend=static", f"--node-rank={nodes.node_rank}"]
        conf: dict[str, object] = dict(nodes.rdzv_conf)
    else:  # is_host decided by the address, not torch's guess from the host name (nodes.py)
        args.append(f"--rdzv-backend={MULTI_HOST_BACKEND}")
        conf = {k: int(v) if isinstance(v, bool) else v for k, v in nodes.rdzv_configs().items()}
    if conf:
        args.append("--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items()))
    return args
