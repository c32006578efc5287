"""Checks of a training run that can be made before any worker starts, so bad input costs one line
and exit code 2 instead of a traceback from every worker, or a failure after training.

`check_config` (the CLI's): the batch splits and the device exists for every world size the run may
use. `preflight` (the CLI's, given the task the config names): the task is probed (its model built,
a couple of items of each dataset run through the model, loss and metrics) and its training set
compared with the global batch. `check_before_start` (the
launcher's, for API callers too): the file system and the transport; `check_resume_point` (the
launcher's, under the directory's lock): the run a checkpoint directory holds, and the checkpoint a
`--resume` would continue. They look, never create: a run refused here has written nothing.
"""

from __future__ import annotations

import hashlib
import re
import uuid
import warnings
from collections.abc import Collection, Sized
from pathlib import Path
from typing import cast

import torch

from dpscale.errors import ConfigError
from dpscale.paths import check_writable_dir
from dpscale.train.checkpoint.files import CheckpointWarning, LoadedCheckpoint, load_latest, runs_in
from dpscale.train.checkpoint.resume import check_resumable
from dpscale.train.config import TrainConfig
from dpscale.train.device import check_gpu_count
from dpscale.train.state import TrainState
from dpscale.workloads.task import Task, probe

# the config's optimizer, which a task's own (Task.optimizer) replaces
OPTIMIZER_FIELDS = ("optimizer", "lr", "momentum", "weight_decay")


def check_config(cfg: TrainConfig, world_sizes: list[int]) -> None:
    """ValueError (one line) for a config that cannot run at these world sizes on this host: the
    batch does not split, the device is missing, a directory or the transport is unusable."""
    for n in sorted(set(world_sizes), reverse=True):
        cfg.resolve_batch(n)
        if cfg.device != "cpu":
            check_gpu_count(cfg.device, n)
    check_before_start(cfg)


def preflight(cfg: TrainConfig, task: Task, given: Collection[str] = ()) -> None:
    """ValueError (one line, naming what to change) for anything in `task` that would fail in the
    workers, or be ignored: `given` names the fields the user set (flags, --config), not the
    defaults. Run `check_config` first: it is cheaper than building the task."""
    probe(task)
    ignored = [f"--{name.replace('_', '-')}" for name in OPTIMIZER_FIELDS if name in given]
    if task.optimizer is not None and ignored:
        raise ConfigError(
            f"{', '.join(ignored)}: the task builds its own optimizer (Task.optimizer), which "
            f"{'this flag does' if len(ignored) == 1 else 'these flags do'} not change; drop "
            f"{'it' if len(ignored) == 1 else 'them'}, or drop Task.optimizer so that the flags "
            "choose the optimizer"
        )
    assert cfg.data.global_batch is not None  # TrainConfig resolves it (auto: the start batch)
    samples = len(cast(Sized, task.train_data))  # probe() checked that it has a length
    # drop: no complete batch; pad: a step of mostly repeated samples (and 10**12 of them allocated)
    if cfg.data.tail in ("drop", "pad") and samples < cfg.data.global_batch:
        raise ConfigError(
            f"train_data has {samples} samples, fewer than one global batch of "
            f"{cfg.data.global_batch}; use --global-batch {samples} or less, or --tail keep"
        )


def check_before_start(cfg: TrainConfig) -> None:
    """What fails only inside the workers or after training: directories, the transport. (A
    `--resume` whose directory does not exist yet starts fresh: a supervisor's first launch.)"""
    if cfg.checkpoint.dir:
        check_writable_dir("--checkpoint-dir", cfg.checkpoint.dir)
    if cfg.metrics.dir:
        check_writable_dir("--metrics-dir", cfg.metrics.dir)
        metrics = Path(cfg.metrics.dir) / "metrics.jsonl"
        if metrics.is_symlink() or (metrics.exists() and not metrics.is_file()):
            # rank 0 would refuse it only after the workers started (paths.open_no_follow)
            raise ConfigError(f"--metrics-dir: {metrics} is a symbolic link or not a regular file; remove it")
    if cfg.metrics.trace:
        check_writable_dir("--trace", cfg.metrics.trace)
    if cfg.engine.transport == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--transport nccl needs CUDA GPUs and none is available; use auto, gloo or shm")


def check_run(cfg: TrainConfig, shared_id: str | None = None) -> tuple[str | None, dict | None]:
    """The run a launch continues or starts in checkpoint_dir: (its run id, the checkpoint that
    verified, for the workers not to hash it again). A fresh run on a directory holding checkpoints
    is refused unless start_over (the launcher then deletes them); with resume, the newest
    checkpoint must fit (check_resume_point). `shared_id` (several hosts: the rendezvous id) names
    a fresh run alike on every host; across hosts a resume leaves the id to rank 0 (None), as not
    every host may see the checkpoints."""
    if not cfg.checkpoint.dir:
        return cfg.checkpoint.run_id, None
    if cfg.checkpoint.resume:
        loaded = check_resume_point(cfg)
        if loaded is not None:
            return (loaded.run_id if shared_id is None else None), loaded.verified
    elif not cfg.checkpoint.start_over and (runs := runs_in(cfg.checkpoint.dir)):
        held = "; ".join(f"run {run}, steps {_steps(steps)}" for run, steps in runs.items())
        raise ConfigError(
            f"--checkpoint-dir {cfg.checkpoint.dir} holds the checkpoints of another run ({held}): "
            "continue it with --resume, delete them and start a new run with --start-over, or "
            "name another --checkpoint-dir"
        )
    if cfg.checkpoint.run_id is not None:
        return cfg.checkpoint.run_id, None
    if shared_id is not None:  # every host computes the same name
        readable = re.sub(r"[^A-Za-z0-9_-]", "", shared_id)[:32]
        return f"{readable}-{hashlib.sha256(shared_id.encode()).hexdigest()[:8]}", None
    return uuid.uuid4().hex[:16], None


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 4 else f"{steps[0]} to {steps[-1]}"


def check_resume_point(cfg: TrainConfig) -> LoadedCheckpoint | None:
    """With --resume: the newest checkpoint (of run_id, when given) that verifies can continue this
    run (same global batch), or there is none yet; returns it. Otherwise every worker would fail on
    it with a traceback (and be restarted to fail again). Every file is verified; only the
    trainer's state is loaded."""
    if not cfg.checkpoint.resume or not cfg.checkpoint.dir:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)  # rank 0 names each rejected one again
        loaded = load_latest(
            cfg.checkpoint.dir, expected_stems=("trainer",), only=("trainer",), run_id=cfg.checkpoint.run_id
        )
    if loaded is None:
        return None
    saved = TrainState.from_state_dict(loaded.payload["trainer"], loaded.path / "trainer.pt")
    assert cfg.data.global_batch is not None  # TrainConfig resolves it
    check_resumable(
        saved,
        global_batch=cfg.data.global_batch,
        world_change=cfg.checkpoint.world_change,
        where=loaded.path,
        auto_batch=cfg.adaptive.auto_batch,
    )
    return loaded


def resume_note(cfg: TrainConfig) -> str | None:
    """A line for a `--resume` that has nothing to resume from (the run starts at step 0), else None.

    Not an error: a supervisor that always passes --resume must be able to start a job's first run.
    """
    if not cfg.checkpoint.resume or not cfg.checkpoint.dir:
        return None
    directory = Path(cfg.checkpoint.dir)
    if directory.is_dir() and any(p.name.startswith("step-") for p in directory.iterdir()):
        return None
    return f"--resume: no checkpoint in {cfg.checkpoint.dir} yet; starting from step 0"
