"""`python -m dpscale.launch.run_child SCRIPT [ARGS...]`: what each worker of `dpscale run` executes
(`forked` in a worker forked from the server, fork_start.py; `main` in one started afresh).

Before the script runs, `torch.nn.parallel.DistributedDataParallel` is replaced by the engine the
launcher chose (through the environment): dpscale's, or torch's own with step telemetry. Scripts
import the class after that (`from torch.nn.parallel import DistributedDataParallel as DDP`), so
they get the stand-in without a changed line. The script then runs as `python SCRIPT ARGS` would:
as `__main__`, with its own directory first on sys.path and sys.argv[0] set to it.

With a step limit (`dpscale scale`), each rank writes its telemetry once the limit is reached and
the run ends there: all ranks meet at a barrier at the same synchronized step (the step count is
the same everywhere), give the engine's buffers back and leave at once (process_life.exit_now):
the script's own `finally` blocks and atexit handlers do not run, as Python's teardown with the
script's gloo threads alive could abort the rank. Nothing is killed. At the limit the ranks first gather
every rank's record, and each host's local rank 0 writes them all: a job across hosts leaves the
whole job's telemetry on every host, with no shared directory. A script that builds no DDP model
is measured from its top-level model and optimizer (launch/script_watch.py); each of its ranks
stops on its own at the limit and writes only its own record (they share no step to meet at).

Every rank that builds a DDP model leaves a mark for the launcher (BUILT_ENV), so `dpscale run`
can say when the ranks never synchronized, and every rank writes what it saw of the script there
(launch/script_checks.py: accumulation without no_sync, BatchNorm, unused parameters, the learning
rate, the process group's interface) when it leaves, at the step limit too.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

from dpscale.comm.attempt import gloo_interface_hint
from dpscale.comm.select import host_id
from dpscale.engine.reducer import UnusedParametersError
from dpscale.launch.engine_try import TRY_ENV, parse_try
from dpscale.launch.process_life import die_with_parent, exit_now, parent_of, set_process_name
from dpscale.launch.script_checks import ScriptFacts, interface_problem, say_now
from dpscale.launch.script_main import as_main

ENGINE_ENV = "DPSCALE_RUN_ENGINE"  # dpscale | torch
TELEMETRY_ENV = "DPSCALE_RUN_TELEMETRY"  # directory for rank<r>.json; unset: no telemetry
LIMIT_ENV = "DPSCALE_RUN_STEPS"  # stop after this many synchronized steps; unset: run to the end
BUILT_ENV = "DPSCALE_RUN_BUILT"  # directory where each rank that builds a DDP model leaves built-rank<r>
LAUNCHER_ENV = "DPSCALE_RUN_LAUNCHER"  # the command's pid: a forked worker's server's parent
TRACE_ENV = "DPSCALE_RUN_TRACE"  # A:B: the steps whose records carry what a trace needs (engine/trace.py)


# what this rank saw of the script, and where it goes when the rank leaves (install sets both)
_facts = ScriptFacts()
_facts_dir: list[str] = []


def _write_facts() -> None:
    if _facts_dir:
        _facts.write(_facts_dir[0])


def stand_in(
    engine: str, telemetry_dir: str | None, limit: int | None, built_dir: str | None = None, watch=None
) -> type:
    """The class that replaces torch's DDP in this worker.

    Building one leaves `built-rank<r>` in `built_dir` (the launcher's sign that the ranks
    synchronize); with `watch` (launch/script_watch.py) its telemetry gets the script's backward,
    optimizer and checkpoint stamps."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from dpscale.engine import DistributedDataParallel
    from dpscale.engine.hooks import fp16_compress_hook
    from dpscale.engine.telemetry import TelemetryDDP, TorchTelemetryDDP

    base: Any
    if telemetry_dir is None:
        base = DistributedDataParallel if engine == "dpscale" else nn.parallel.DistributedDataParallel
    else:
        base = TelemetryDDP if engine == "dpscale" else TorchTelemetryDDP

    fix = parse_try(os.environ[TRY_ENV]) if os.environ.get(TRY_ENV) else None

    class Measured(base):
        def __init__(self, *args, **kwargs):
            if fix is not None and fix.kind == "bucket_cap_mb":
                kwargs["bucket_cap_mb"] = fix.value
            super().__init__(*args, **kwargs)
            if fix is not None and fix.kind == "fp16":
                self.register_comm_hook(self.process_group, fp16_compress_hook)
            self._synced_forwards = 0
            group = self.process_group
            self._where = (dist.get_rank(group), dist.get_world_size(group), dist.get_backend(group))
            if built_dir is not None:
                (Path(built_dir) / f"built-rank{self._where[0]}").touch()
            if telemetry_dir is None:
                return
            self.telemetry.limit = limit
            self.telemetry.on_limit = lambda t: _stop(self, telemetry_dir)
            _set_trace(self.telemetry, limit)
            if watch is not None:
                watch.ddp_built(self.telemetry, self)
            # a script that ends before the limit still leaves what it measured
            atexit.register(_write, self, telemetry_dir, final=False)

        def forward(self, *inputs, **kwargs):
            if not (self.training and torch.is_grad_enabled()):
                return super().forward(*inputs, **kwargs)
            _facts.on_training_forward(self.module, bool(self.require_backward_grad_sync))
            if fix is None or fix.kind != "accumulation" or not self.require_backward_grad_sync:
                return super().forward(*inputs, **kwargs)
            # --try accumulation=K: K - 1 of every K synced steps run as under no_sync() (engine_try.py)
            self._synced_forwards += 1
            if self._synced_forwards % int(fix.value or 1) == 0:
                return super().forward(*inputs, **kwargs)
            with self.no_sync():
                return super().forward(*inputs, **kwargs)

    Measured.__name__ = Measured.__qualname__ = "DistributedDataParallel"
    return Measured


def _set_trace(telemetry, limit: int | None) -> None:
    """Stamp the steps of the trace window (TRACE_ENV) for the trace; without a step limit keep
    only those records, so a traced run of any length holds a bounded telemetry."""
    from dpscale.engine.trace import TraceWindow

    if window := os.environ.get(TRACE_ENV):
        telemetry.trace = TraceWindow.parse(window)
        telemetry.trace_only = limit is None


def _record(ddp, *, final: bool) -> dict:
    rank, world, backend = ddp._where
    transport = ddp.transport.name if hasattr(ddp, "transport") else backend
    return _telemetry_doc(ddp.telemetry, ddp.module, rank, world, transport, final=final, ddp=True)


def _telemetry_doc(
    telemetry, module, rank: int, world: int, transport: str, *, final: bool, ddp: bool
) -> dict:
    params = list(module.parameters()) if module is not None else []
    return {
        "rank": rank,
        "world_size": world,
        "final": final,
        "ddp": ddp,  # False: no DDP model; steps end at the optimizer's step() (script_watch.py)
        "transport": transport,
        "param_count": sum(p.numel() for p in params),
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "host": host_id(),  # what the transports take a host to be (hostname + /dev/shm, DPSCALE_HOST_ID)
        **telemetry.to_dict(),
    }


def _write(ddp, directory: str, *, final: bool) -> None:
    path = Path(directory) / f"rank{ddp._where[0]}.json"
    if not path.exists():  # else the final record was written at the limit
        _write_doc(path, _record(ddp, final=final))


def _write_doc(path: Path, doc: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)


def _stop(ddp, directory: str) -> None:
    import torch.distributed as dist

    docs: list[Any] = [None] * ddp._where[1]
    dist.all_gather_object(docs, _record(ddp, final=True), group=ddp.process_group)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        for doc in docs:
            _write_doc(Path(directory) / f"rank{doc['rank']}.json", doc)
    # every rank reaches this at the same step; meeting here means no rank leaves while a peer
    # still reads its part of the last reduction
    dist.barrier(group=ddp.process_group)
    _write_facts()  # exit_now skips atexit
    if hasattr(ddp, "close"):
        ddp.close()  # dpscale's shared-memory buffers go back now, not at interpreter exit
    # leave without interpreter teardown: the script's process group and its gloo threads are
    # still alive here, and one of them needing the GIL while Python finalizes aborts the rank
    # (SIGABRT), failing a measurement that completed (process_life.exit_now)
    exit_now(0)


def _watch_unwrapped(telemetry_dir: str, limit: int | None):
    """Watch the script's steps; until it builds a DDP model, from its top-level model alone. Each
    rank then writes only its own record: ranks without DDP do not meet at a common step."""
    from dpscale.engine.telemetry import StepTelemetry
    from dpscale.launch.script_watch import ScriptWatch

    watch = ScriptWatch()
    telemetry = StepTelemetry(limit=limit)
    _set_trace(telemetry, limit)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    path = Path(telemetry_dir) / f"rank{rank}.json"

    def write(final: bool) -> None:
        if watch.unwrapped is not None and not path.exists():
            _write_doc(
                path,
                _telemetry_doc(
                    telemetry, watch.unwrapped.module, rank, world, "none", final=final, ddp=False
                ),
            )

    def stop(t) -> None:
        write(final=True)
        _write_facts()
        exit_now(0)  # as _stop: a process group the script made may hold gloo threads

    telemetry.on_limit = stop
    atexit.register(write, False)
    watch.install(telemetry)
    return watch


# the timeout the script gave init_process_group, if it gave one (seconds)
_script_timeout_s: list[float] = []


def _watch_init_process_group() -> None:
    """Have init_process_group (both places scripts import it from) note the timeout the script gives
    and check, before it connects, that its traffic between hosts takes the rendezvous' interface.

    torch's DDP waits on its collectives as long as the process group says; dpscale's engine has a
    timeout of its own (300 s), which would otherwise hold the job that long after a rank left.
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    torchs = c10d.init_process_group

    @functools.wraps(torchs)
    def init_process_group(*args, **kwargs):
        timeout = kwargs.get("timeout")
        if timeout is not None:
            _script_timeout_s[:] = [timeout.total_seconds()]
        backend = kwargs.get("backend", args[0] if args else None) or "gloo"
        # said now as well as at the end: a process group on the wrong interface may never connect
        if problem := interface_problem(str(backend).split(":")[-1]):
            _facts.interface = problem
            say_now(problem)
        return torchs(*args, **kwargs)

    dist.init_process_group = c10d.init_process_group = init_process_group


def _with_script_timeout(cls: type) -> type:
    """`cls` (dpscale's engine) with the script's process-group timeout as its collective timeout."""

    class DistributedDataParallel(cls):
        def __init__(self, *args, **kwargs):
            if _script_timeout_s and "collective_timeout_s" not in kwargs:
                kwargs["collective_timeout_s"] = _script_timeout_s[0]
            super().__init__(*args, **kwargs)

    DistributedDataParallel.__qualname__ = "DistributedDataParallel"
    return DistributedDataParallel


def install(
    engine: str, telemetry_dir: str | None = None, limit: int | None = None, built_dir: str | None = None
) -> None:
    """Make torch.nn.parallel.DistributedDataParallel (both places scripts import it from) the stand-in."""
    import torch.nn.parallel as parallel
    import torch.nn.parallel.distributed as distributed
    from torch.optim.optimizer import register_optimizer_step_post_hook

    global _facts
    _facts = ScriptFacts.from_env()
    if built_dir is not None:
        _facts_dir[:] = [built_dir]
        atexit.register(_write_facts)
    register_optimizer_step_post_hook(lambda optimizer, args, kwargs: _facts.on_optimizer_step(optimizer))
    watch = _watch_unwrapped(telemetry_dir, limit) if telemetry_dir is not None else None
    cls = stand_in(engine, telemetry_dir, limit, built_dir, watch)
    _watch_init_process_group()
    if engine == "dpscale":
        cls = _with_script_timeout(cls)
    parallel.DistributedDataParallel = cls  # type: ignore[misc,assignment]  # the point: scripts get the stand-in
    distributed.DistributedDataParallel = cls  # type: ignore[misc,assignment]


def main(argv: list[str] | None = None) -> None:
    """`python -u -m dpscale.launch.run_child SCRIPT ARGS`: a worker started afresh."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        sys.exit("usage: python -m dpscale.launch.run_child SCRIPT [ARGS...]")
    die_with_parent(os.getppid())  # torchrun's agent: a rank never outlives it
    _run_script(argv)


def forked(*argv: str) -> int:
    """A worker forked from the server the command started (fork_start.py), the server being its
    parent: what `main` does, the script run as a fresh interpreter runs it (script_main.py)."""
    set_process_name(f"dpscale-rank{os.environ.get('RANK', '')}")  # the command line is the server's
    # a session of its own, as torch starts each worker in: a terminal's Ctrl-C (to the command's
    # process group, the server's) must reach the script once, from the agent, not twice
    os.setsid()
    server = os.getppid()
    if parent_of(server) not in (int(os.environ[LAUNCHER_ENV]), None):  # the command is gone: so are we
        return 1
    die_with_parent(server)  # which ends when the command does
    return as_main(lambda: _run_script(list(argv)))


def _run_script(argv: list[str]) -> None:
    script = os.path.abspath(argv[0])
    limit = os.environ.get(LIMIT_ENV)
    engine, telemetry_dir = os.environ.get(ENGINE_ENV, "dpscale"), os.environ.get(TELEMETRY_ENV)
    install(engine, telemetry_dir, int(limit) if limit else None, os.environ.get(BUILT_ENV))
    # the script's own init_process_group: where this host's name resolves to loopback, gloo would
    # advertise 127.0.0.1 to the other hosts; name the interface toward the store (as `dpscale train`)
    if ifname := gloo_interface_hint(os.environ.get("MASTER_ADDR")):
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    sys.argv = [argv[0], *argv[1:]]
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` does (here it was the cwd for -m)
    try:
        runpy.run_path(script, run_name="__main__")
    except UnusedParametersError as e:  # the engine's error, kept as a record for the launcher's advice
        _facts.unused = e.names
        raise


if __name__ == "__main__":
    main()
