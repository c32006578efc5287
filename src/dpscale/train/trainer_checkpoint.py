"""The trainer's checkpoints: what a checkpoint holds, and resuming from one, also at another world size.

`checkpoint.py` knows files (atomic writes, verified weights_only loads); this file knows the
trainer (which state, which ranks do what). Both directions are collective and keep ranks in
lockstep: rank 0 reads or writes and broadcasts the outcome, an error included, so a failure on
rank 0 stops every rank with the same message instead of leaving the others in a collective.

The sampler position is counted in global batches, so a checkpoint resumes at any world size.
When it does, the trainer keeps the global batch (the optimization is the same) and the saved
micro-batch (what fits a worker's memory) and changes the accumulation steps, and says so.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from ..comm.base import global_rank
from .checkpoint import (
    CheckpointError,
    CheckpointWarning,
    LoadedCheckpoint,
    capture_rng_state,
    load_checkpoint,
    load_latest,
    restore_rng_state,
    save_checkpoint,
)

if TYPE_CHECKING:
    from .trainer import Trainer

STEMS = ("model", "optimizer", "scheduler", "sampler", "trainer", "rng")
# trainer.pt entries that must be non-negative ints; anything else means a corrupt or foreign file
_COUNTS = ("step", "samples_seen", "skipped_steps", "world_size", "global_batch")


def save(t: Trainer) -> str:
    """Collective: every rank sends its RNG state; rank 0 writes; all learn the path (or the error)."""
    rngs: list = [None] * t.world_size
    t.log.record("all_gather_object", "RNG states for a checkpoint")
    dist.all_gather_object(rngs, capture_rng_state(), group=t.group)
    outcome: list = [None, None]  # path, error
    error: Exception | None = None
    if t.rank == 0:
        payload = {
            "model": t.model.module.state_dict(),
            "optimizer": t.optimizer.state_dict(),
            "scheduler": t.scheduler.state_dict(),
            "sampler": t.sampler.state_dict(),
            "trainer": {
                "step": t.step,
                "samples_seen": t.samples_seen,
                "skipped_steps": t.skipped_steps,
                "world_size": t.world_size,
                "global_batch": t.cfg.global_batch,
                "micro_batch": t.micro_batch,
                "accumulation_steps": t.accumulation_steps,
                "last_loss": t.last_loss,
            },
            "rng": {"ranks": rngs},
        }
        try:
            path = save_checkpoint(t.cfg.checkpoint_dir, t.step, payload, keep_last=t.cfg.keep_checkpoints)
            outcome = [str(path), None]
        except Exception as e:  # every rank must learn of it, or the others wait for a path forever
            error, outcome = e, [None, f"{type(e).__name__}: {e}"]
    t.log.record("broadcast_object", "checkpoint outcome")
    dist.broadcast_object_list(outcome, src=_global_rank0(t), group=t.group)
    if error is not None:
        raise error
    if outcome[1] is not None:
        raise RuntimeError(f"rank 0 could not write the checkpoint of step {t.step}: {outcome[1]}")
    return outcome[0]


def resume(t: Trainer) -> None:
    """Collective: continue from the newest checkpoint that verifies; a fresh start if there is none."""
    root = Path(t.cfg.checkpoint_dir)
    choice: list = [None, None]  # path, error
    loaded: LoadedCheckpoint | None = None
    if t.rank == 0:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", CheckpointWarning)  # reported below, one line each
                loaded = load_latest(root, expected_stems=STEMS)
            choice = [str(loaded.path) if loaded else None, None]
            for line in loaded.skipped if loaded else []:
                print(f"dpscale: rejected {line}; trying an older checkpoint", file=sys.stderr, flush=True)
        except Exception as e:  # as in save(): the other ranks must not wait for a path forever
            choice = [None, f"{type(e).__name__}: {e}"]
    t.log.record("broadcast_object", "checkpoint to resume from")
    dist.broadcast_object_list(choice, src=_global_rank0(t), group=t.group)
    if choice[1] is not None:
        raise CheckpointError(f"cannot resume from {root}: {choice[1]}")
    if choice[0] is None:
        return  # nothing saved yet: a fresh start
    # Every rank loads and applies the checkpoint itself; one that fails (no shared file system,
    # a file damaged since rank 0 verified it) must stop the others too, not leave them waiting
    # in the first training collective until it times out.
    try:
        _apply(t, choice[0], loaded)
        error = None
    except Exception as e:  # noqa: BLE001 - reported to every rank, then raised everywhere
        error = f"rank {t.rank}: {type(e).__name__}: {e}"
    errors: list = [None] * t.world_size
    t.log.record("all_gather_object", "resume outcome")
    dist.all_gather_object(errors, error, group=t.group)
    failed = [e for e in errors if e]
    if failed:
        raise CheckpointError(f"cannot resume from {choice[0]}: {'; '.join(failed)}")


def _apply(t: Trainer, path: str, loaded: LoadedCheckpoint | None) -> None:
    ckpt = loaded or load_checkpoint(path, expected_stems=STEMS)
    payload, where = ckpt.payload, ckpt.path
    state = _trainer_state(payload["trainer"], where)
    if state["global_batch"] != t.cfg.global_batch:
        raise ValueError(
            f"checkpoint {where} was trained with global_batch {state['global_batch']}, this run "
            f"asks for {t.cfg.global_batch}; use the same global batch to resume"
        )
    if state["world_size"] != t.world_size:
        _resplit(t, state)
    _load_into(t.model.module.load_state_dict, payload["model"], where / "model.pt")
    _load_into(t.optimizer.load_state_dict, payload["optimizer"], where / "optimizer.pt")
    _load_into(t.scheduler.load_state_dict, payload["scheduler"], where / "scheduler.pt")
    _load_into(t.sampler.load_state_dict, payload["sampler"], where / "sampler.pt")
    t.step = state["step"]
    t.samples_seen = state["samples_seen"]
    t.skipped_steps = state["skipped_steps"]
    t.last_loss = state.get("last_loss")
    rngs = payload["rng"].get("ranks") if isinstance(payload["rng"], dict) else None
    if not rngs:
        raise CheckpointError(f"checkpoint {where / 'rng.pt'} holds no RNG states")
    # a restart with more workers than before: ranks beyond the old world reuse a saved stream
    restore_rng_state(rngs[t.rank % len(rngs)])
    t.resumed_from = t.step
    t.last_checkpoint = str(where)


def _resplit(t: Trainer, state: dict) -> None:
    """Keep the global batch at a new world size: the saved micro-batch if it fits, else the config's."""
    g, old_world = t.cfg.global_batch, state["world_size"]
    old_micro = state.get("micro_batch")
    old_k = state.get("accumulation_steps")
    if isinstance(old_micro, int) and old_micro > 0 and g % (t.world_size * old_micro) == 0:
        t.set_batch_split(old_micro, g // (t.world_size * old_micro))
        how = "same micro-batch"
    else:
        how = "micro-batch from the configuration"  # already resolved for this world size
    if t.rank == 0:
        print(
            f"dpscale: checkpoint written by {old_world} workers, resuming with {t.world_size}: global "
            f"batch {g} kept; micro-batch {old_micro} -> {t.micro_batch}, accumulation steps {old_k} -> "
            f"{t.accumulation_steps} ({how}); results match the uninterrupted run up to floating-point "
            "summation order",
            file=sys.stderr,
            flush=True,
        )


def _trainer_state(state: object, where: Path) -> dict:
    # the file passed its checksum, but the manifest is no signature: check what the loop relies on
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {where / 'trainer.pt'} holds a {type(state).__name__}, not a dict")
    for key in _COUNTS:
        value = state.get(key)
        if type(value) is not int or value < 0 or (key in ("world_size", "global_batch") and value < 1):
            raise CheckpointError(
                f"checkpoint {where / 'trainer.pt'}: {key} is {value!r}, not a valid count; "
                "the file is corrupt or was not written by dpscale"
            )
    return state


def _load_into(load_state_dict, state: object, path: Path) -> None:
    try:
        load_state_dict(state)
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as e:
        reason = " ".join(str(e).split())[:400] or type(e).__name__
        raise CheckpointError(f"checkpoint {path} does not fit this run: {reason}") from None


def _global_rank0(t: Trainer) -> int:
    return global_rank(t.group, 0)
