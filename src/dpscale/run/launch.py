"""Start a user's script on N local workers as `torchrun --standalone` does, through `dpscale.run.child`.

torchrun (torch.distributed.run) does the rendezvous on this host with a port it picks, sets
RANK, LOCAL_RANK, WORLD_SIZE and MASTER_* for each worker and forwards signals; each worker runs
`python -m dpscale.run.child SCRIPT ARGS`, which installs the stand-in engine and runs the script.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..engine.registry import RUN_ENGINES
from ..errors import ConfigError
from .child import ENGINE_ENV, LIMIT_ENV, TELEMETRY_ENV


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
) -> int:
    """Run `script args` on `nproc` workers; the exit code torchrun reports (0: every worker succeeded).

    With `telemetry_dir`, each worker writes its step telemetry there as rank<r>.json, and with
    `steps` the run ends cleanly after that many synchronized steps. `threads` sets
    OMP_NUM_THREADS for the workers unless the caller's environment sets it. With `log_path`
    the workers' output goes there instead of this terminal.
    """
    RunConfig(nproc=nproc, engine=engine)  # the same checks as the flags get
    check_script(script)
    env = dict(os.environ, **{ENGINE_ENV: engine})
    for name, value in ((TELEMETRY_ENV, telemetry_dir), (LIMIT_ENV, steps)):
        env.pop(name, None)
        if value is not None:
            env[name] = str(value)
    if threads is not None:
        env.setdefault("OMP_NUM_THREADS", str(threads))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "dpscale.run.child",
        script,
        *args,
    ]
    if log_path is None:
        return subprocess.run(cmd, env=env).returncode
    with open(log_path, "w") as log:
        return subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
