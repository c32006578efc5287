"""`Checkpointer`: saves and restores named Stateful objects, collectively, through files.py's files.

A Stateful (torch.distributed.checkpoint's protocol) is anything with `state_dict()` and
`load_state_dict(state)` (torch modules, optimizers, schedulers, the sampler, `TrainState`, ...).
The manager knows names and the protocol, not what the states mean: the trainer says which
objects to save and applies a loaded checkpoint itself.

Both directions are collective and keep ranks in lockstep: rank 0 reads or writes and broadcasts
the outcome, an error included, so a failure on rank 0 stops every rank with the same message
instead of leaving the others in a collective. Per-rank states (RNG streams, a comm hook's error
feedback) are gathered to rank 0 and saved as `{"ranks": [one per rank]}`.

Each checkpoint names the run that wrote it (files.py); a resume loads only its run's, and a
checkpointer not told its run (`run_id=None`) takes the run of the checkpoint it resumes, or a new
one. Only rank 0 reads or writes, so only rank 0's run id matters.
"""

from __future__ import annotations

import uuid
import warnings
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from dpscale.comm.base import global_rank
from dpscale.engine.collective_log import CollectiveLog
from dpscale.log import get_logger
from dpscale.train.checkpoint.files import (
    CheckpointError,
    CheckpointWarning,
    LoadedCheckpoint,
    load_checkpoint,
    load_latest,
    save_checkpoint,
)

if TYPE_CHECKING:
    # torch.distributed.checkpoint costs ~1 s of import time in every process (workers, the CLI):
    # the protocol is only an annotation here
    from torch.distributed.checkpoint.stateful import Stateful

logger = get_logger(__name__)


class Checkpointer:
    def __init__(
        self,
        directory: str | Path,
        *,
        group: dist.ProcessGroup | None,
        log: CollectiveLog,
        keep_last: int,
        expected_stems: Collection[str],
        on_file: Callable[[int, str], None] | None = None,
        run_id: str | None = None,
    ):
        """`expected_stems`: the files every checkpoint must hold (others, like a hook's, may be
        absent); `on_file(step, stem)` runs on rank 0 after each file is written (trainer callbacks);
        `run_id`: the run whose checkpoints these are (None: the resumed checkpoint's, or a new one)."""
        self.directory = Path(directory)
        self.group = group
        self.log = log
        self.keep_last = keep_last
        self.expected_stems = tuple(expected_stems)
        self.on_file = on_file
        self.run_id_given = run_id is not None
        self.run_id = run_id if run_id is not None else uuid.uuid4().hex[:16]
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def save(
        self,
        step: int,
        shared: Mapping[str, Stateful],
        per_rank: Mapping[str, Stateful] | None = None,
        extra: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> str:
        """Collective: rank 0 writes `shared`'s states and every rank's `per_rank` states; all learn
        the path (or the error). `extra[name]` adds keys beside a per-rank entry's "ranks"."""
        gathered: dict[str, list | None] = {}
        for name, obj in (per_rank or {}).items():  # each rank's, to rank 0 only
            states: list | None = [None] * self.world_size if self.rank == 0 else None
            self.log.record("gather_object", f"{name} states for a checkpoint")
            dist.gather_object(obj.state_dict(), states, dst=self._rank0, group=self.group)
            gathered[name] = states
        outcome: list = [None, None]  # path, error
        error: Exception | None = None
        if self.rank == 0:
            payload = {name: obj.state_dict() for name, obj in shared.items()}
            for name, states in gathered.items():
                payload[name] = {**(extra or {}).get(name, {}), "ranks": states}
            try:
                path = save_checkpoint(
                    self.directory,
                    step,
                    payload,
                    keep_last=self.keep_last,
                    on_file=self.on_file,
                    run_id=self.run_id,
                )
                outcome = [str(path), None]
            except Exception as e:  # every rank must learn of it, or the others wait for a path forever
                error, outcome = e, [None, f"{type(e).__name__}: {e}"]
        self.log.record("broadcast_object", "checkpoint outcome")
        dist.broadcast_object_list(outcome, src=self._rank0, group=self.group)
        if error is not None:
            raise error
        if outcome[1] is not None:
            raise RuntimeError(f"rank 0 could not write the checkpoint of step {step}: {outcome[1]}")
        return outcome[0]

    def resume(
        self, apply: Callable[[LoadedCheckpoint], None], trusted: dict[str, Any] | None = None
    ) -> str | None:
        """Collective: `apply` the newest checkpoint of this run that verifies on every rank; its
        path, or None (a fresh start) when there is none. Raises CheckpointError on every rank if
        one rank fails. `trusted`: what the launcher verified (files.load_latest), not hashed again."""
        choice: list = [None, None, False]  # path, error, whether the error is the file system's
        loaded: LoadedCheckpoint | None = None
        if self.rank == 0:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", CheckpointWarning)  # reported below, one line each
                    loaded = load_latest(
                        self.directory,
                        expected_stems=self.expected_stems,
                        run_id=self.run_id if self.run_id_given else None,
                        trusted=trusted,
                    )
                if loaded is not None:
                    self.run_id = loaded.run_id
                choice = [str(loaded.path) if loaded else None, None, False]
                for line in loaded.skipped if loaded else []:
                    logger.warning("rejected %s; trying an older checkpoint", line)
            except Exception as e:  # as in save(): the other ranks must not wait for a path forever
                choice = [None, f"{type(e).__name__}: {e}", isinstance(e, OSError)]
        self.log.record("broadcast_object", "checkpoint to resume from")
        dist.broadcast_object_list(choice, src=self._rank0, group=self.group)
        if choice[1] is not None:
            _raise(f"cannot resume from {self.directory}: {choice[1]}", transient=choice[2])
        if choice[0] is None:
            return None  # nothing saved yet: a fresh start
        # Every rank loads and applies the checkpoint itself; one that fails (no shared file system,
        # a file damaged since rank 0 verified it) must stop the others too, not leave them waiting
        # in the first training collective until it times out.
        try:
            apply(loaded or load_checkpoint(choice[0], expected_stems=self.expected_stems))
            error, transient = None, False
        except Exception as e:  # noqa: BLE001 - reported to every rank, then raised everywhere
            error, transient = f"{type(e).__name__}: {e}", isinstance(e, OSError)
        outcomes: list = [None] * self.world_size
        self.log.record("all_gather_object", "resume outcome")
        dist.all_gather_object(outcomes, (error, transient), group=self.group)
        errors = [e for e, _ in outcomes]
        if any(errors):
            message = f"cannot resume from {choice[0]}: {_by_rank(errors)}"
            _raise(message, transient=any(t for _, t in outcomes))
        return choice[0]

    @property
    def _rank0(self) -> int:
        return global_rank(self.group, 0)


def _by_rank(errors: list[str | None]) -> str:
    """Each distinct error once, with the ranks that had it ("every rank" when all did the same)."""
    ranks: dict[str, list[int]] = {}
    for rank, error in enumerate(errors):
        if error:
            ranks.setdefault(error, []).append(rank)
    if len(ranks) == 1 and len(next(iter(ranks.values()))) == len(errors) > 1:
        return f"every rank: {next(iter(ranks))}"
    return "; ".join(f"rank {', '.join(map(str, r))}: {e}" for e, r in ranks.items())


def load_into(load_state_dict: Callable[[Any], Any], state: object, path: Path) -> None:
    """`load_state_dict(state)`, with a failure reported as a CheckpointError naming the file."""
    try:
        load_state_dict(state)
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as e:
        reason = " ".join(str(e).split())[:400] or type(e).__name__
        raise CheckpointError(f"checkpoint {path} does not fit this run: {reason}") from None


class CheckpointUnreadable(RuntimeError):
    """The file system failed while resuming (an I/O error, a file missing on one host): not the
    checkpoint's fault, so not bad input; the worker fails and the agent restarts it."""


def _raise(message: str, *, transient: bool) -> None:
    # CheckpointError is bad input (a ConfigError: one line, exit 2, no restart); a file system
    # that failed may work on the next attempt
    raise (CheckpointUnreadable if transient else CheckpointError)(message)
