"""Run a function on N ranks of a CPU process group, the way tests and benchmarks need it.

`run_ranks(fn, world_size, *args)` starts one fresh process per rank (forkserver: clean like
spawn, but torch is imported once in the server instead of once per rank; see PRELOAD), joins
them in a gloo group through a FileStore in a temporary directory (no ports at all), runs
`fn(rank, world_size, *args)` and returns the ranks' return values in rank order.

The ranks are one job (launch/job.py): they write into its temp directory, and whatever ends the
caller (a signal, SIGKILL) ends them and removes it. Each rank also takes the kernel's
parent-death signal, without a thread (a rank holds only its own): its parent is the forkserver,
which ends when the caller does.

Failures are loud: when a rank raises, the others get a short grace period and are killed, and
the error shows every rank's traceback. When the timeout passes, every rank is asked (SIGUSR1,
faulthandler) to dump its Python stack before it is killed, so a hang shows where each rank was.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import multiprocessing.forkserver
import multiprocessing.util
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dpscale.launch import fork_start
from dpscale.launch.job import job_scope
from dpscale.launch.process_life import parent_of, set_parent_death_signal
from dpscale.launch.reaper import JOB_ENV

DEFAULT_TIMEOUT_S = 120.0
# After one rank fails, the others usually fail too (their collectives lose a peer); give them
# this long to report their own error before they are killed.
_GRACE_S = 3.0


# What the forkserver imports once, before it forks any rank: a rank then starts with them loaded
# instead of paying their import itself (torch._dynamo among them: torch's optimizers import it on
# their first parameter group, about 1.2 s of CPU in every rank that builds one). One list with
# `dpscale train`'s forked workers (launch/fork_start.py), since a process has one forkserver and
# whichever starts it sets what it preloads.
PRELOAD = tuple(fork_start.PRELOAD)


class MultiRankError(RuntimeError):
    """One or more ranks failed or timed out; the message holds every rank's report."""


def _context() -> mp.context.ForkServerContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple,
    workdir: str,
    backend: str,
    threads: int,
    pg_timeout_s: float,
    env: dict[str, str],
    caller: int,
) -> None:
    set_parent_death_signal()
    # the forkserver, our parent, ends with the caller: if the caller is gone already (before the
    # line above took effect), so is this rank
    if parent_of(os.getppid()) not in (caller, None):
        os._exit(1)
    os.environ.update(env)
    tempfile.tempdir = None  # the job's temp dir (TMPDIR, in env), not the forkserver's
    out = Path(workdir)
    stack_file = open(out / f"rank{rank}.stack", "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if backend:
            store = dist.FileStore(str(out / "store"), world_size)
            dist.init_process_group(
                backend,
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=pg_timeout_s),
            )
            # gloo returns from init on a rank whose side of the mesh is connected while a peer may
            # still be reading the handshake; a rank that then exits at once (a short fn) closes
            # the socket under it: "Connection closed by peer" on the slow rank, ~1 in 12 calls
            # of 4 ranks at load 6. Once every rank is past the barrier, every mesh is complete.
            dist.barrier()
        try:
            result = fn(rank, world_size, *args)
        finally:
            if backend and dist.is_initialized():
                dist.destroy_process_group()
        tmp = out / f"rank{rank}.result.tmp"
        tmp.write_bytes(pickle.dumps(result))
        os.replace(tmp, out / f"rank{rank}.result")
    except BaseException:
        (out / f"rank{rank}.error").write_text(traceback.format_exc())
        raise SystemExit(1) from None


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: str | None = "gloo",
    threads: int = 1,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` processes; return their results.

    `fn` must be importable (a module-level function) and its arguments and result picklable.
    `backend=None` skips the process group (for code that builds its own). `env` is applied in
    every rank before `fn` runs.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    with job_scope() as job, tempfile.TemporaryDirectory(prefix="dpscale-ranks-") as workdir:
        job.start_reaper()  # before the first rank, also where run_ranks is the outermost scope
        # the forkserver serves the caller's later calls too: it starts outside the job (the job's
        # end does not kill it; it ends by itself with the caller), and its socket's directory
        # goes only if the caller dies
        with job.outside():
            multiprocessing.forkserver.ensure_running()
        job.add_path(multiprocessing.util.get_temp_dir())
        # The process group's own timeout sits below ours so that a stuck collective
        # usually surfaces as an error with a message rather than as a kill.
        pg_timeout_s = max(5.0, timeout_s - 10.0)
        caller = os.getpid()
        rank_env = {JOB_ENV: job.id, "TMPDIR": str(job.directory), **(env or {})}
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(
                    fn,
                    r,
                    world_size,
                    args,
                    workdir,
                    backend or "",
                    threads,
                    pg_timeout_s,
                    rank_env,
                    caller,
                ),
                name=f"rank{r}",
            )
            for r in range(world_size)
        ]
        try:
            for p in procs:
                p.start()
                assert p.pid is not None
                job.add(p.pid)  # forked by the server: without this process's environment
            timed_out = _wait(procs, timeout_s)
        finally:
            if any(p.is_alive() for p in procs):
                _dump_stacks(procs)
            _kill(procs)
        return _collect(Path(workdir), procs, timed_out, timeout_s)


def _wait(procs: list, timeout_s: float) -> bool:
    """Wait for all ranks; stop early when one fails. Returns True on timeout."""
    deadline = time.monotonic() + timeout_s
    failed_at = None
    while True:
        alive = [p for p in procs if p.is_alive()]
        if not alive:
            return False
        now = time.monotonic()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now
        if failed_at is not None and now - failed_at > _GRACE_S:
            return False
        if now > deadline:
            return True
        alive[0].join(0.05)


def _dump_stacks(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    time.sleep(0.5)  # let faulthandler write


def _kill(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(10)


def _collect(workdir: Path, procs: list, timed_out: bool, timeout_s: float) -> list[Any]:
    results, reports, ok = [], [], True
    for r, p in enumerate(procs):
        res, err, stack = (workdir / f"rank{r}.{k}" for k in ("result", "error", "stack"))
        if res.exists():
            results.append(pickle.loads(res.read_bytes()))
            reports.append(f"--- rank {r}: ok")
            continue
        ok = False
        if err.exists():
            reports.append(f"--- rank {r}: raised\n{err.read_text()}")
        elif stack.exists() and stack.stat().st_size:
            reports.append(
                f"--- rank {r}: killed (exit {p.exitcode}); stack when stopped:\n{stack.read_text()}"
            )
        else:
            reports.append(f"--- rank {r}: exited with code {p.exitcode} and no report")
    if not ok:
        head = f"ranks timed out after {timeout_s:.0f} s" if timed_out else "a rank failed"
        raise MultiRankError(head + "\n" + "\n".join(reports))
    return results
