"""The trainer's checkpoints: what a checkpoint holds, and resuming from one, also at another world size.

`checkpoint.py` knows files (atomic writes, verified weights_only loads); this file knows the
trainer (which state, which ranks do what). Both directions are collective and keep ranks in
lockstep: rank 0 reads or writes and broadcasts the outcome, an error included, so a failure on
rank 0 stops every rank with the same message instead of leaving the others in a collective.

The sampler position is counted in global batches, so a checkpoint resumes at any world size.
When it does, by default (world_change=keep-global-batch) the trainer keeps the global batch (the
optimization is the same) and the saved micro-batch (what fits a worker's memory) and changes the
accumulation steps. With world_change=scale-lr it keeps each worker's batch instead: the global
batch follows the world size, the sampler goes on from the next unused sample, the LR moves by the
linear rule over a ramp, and the sample budget (epochs, or max_steps x the configured batch) is
kept. Either way it says what it changed. A comm hook's state (PowerSGD) is saved per rank; at
another world size every rank starts from the ranks' mean error, which keeps the pending correction.
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
from .optim import BatchScale, lr_factor, sync_lr

if TYPE_CHECKING:
    from .trainer import Trainer

STEMS = ("model", "optimizer", "scheduler", "sampler", "trainer", "rng")  # + comm_hook with a stateful hook
# trainer.pt entries that must be non-negative ints; anything else means a corrupt or foreign file
_COUNTS = ("step", "samples_seen", "skipped_steps", "world_size", "global_batch", "base_global_batch")
_POSITIVE = ("world_size", "global_batch", "base_global_batch")


def save(t: Trainer) -> str:
    """Collective: every rank sends its RNG state; rank 0 writes; all learn the path (or the error)."""
    rngs: list = [None] * t.world_size
    t.log.record("all_gather_object", "RNG states for a checkpoint")
    dist.all_gather_object(rngs, capture_rng_state(), group=t.group)
    hooks: list | None = [None] * t.world_size if t.rank == 0 else None
    if t.comm_state is not None:  # every rank's (PowerSGD's errors differ per rank), to rank 0 only
        t.log.record("gather_object", "comm hook states for a checkpoint")
        state = t.comm_state.state_dict(t.model.module.named_parameters())
        dist.gather_object(state, hooks, dst=_global_rank0(t), group=t.group)
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
                "global_batch": t.global_batch,
                "base_global_batch": t.cfg.global_batch,
                "batch_scale": t.batch_scale.to_dict(),
                "micro_batch": t.micro_batch,
                "accumulation_steps": t.accumulation_steps,
                "last_loss": t.last_loss,
                # fp16's loss scale and growth count: the same on every rank (device.py)
                "grad_scaler": t.precision.state_dict(),
            },
            "rng": {"ranks": rngs},
        }
        if t.comm_state is not None:
            payload["comm_hook"] = {"compression": t.cfg.compression, "ranks": hooks}
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
    cfg = t.cfg
    if state["base_global_batch"] != cfg.global_batch:
        raise ValueError(
            f"checkpoint {where} was trained with global_batch {state['base_global_batch']}, this run "
            f"asks for {cfg.global_batch}; use the same global batch to resume"
        )
    if state["global_batch"] != cfg.global_batch and cfg.world_change != "scale-lr":
        raise ValueError(
            f"checkpoint {where} had moved to global batch {state['global_batch']} under "
            f"world_change=scale-lr; resume with world_change=scale-lr (--world-change scale-lr)"
        )
    _load_into(t.model.module.load_state_dict, payload["model"], where / "model.pt")
    _load_into(t.optimizer.load_state_dict, payload["optimizer"], where / "optimizer.pt")
    _load_into(t.precision.load_state_dict, state.get("grad_scaler", {}), where / "trainer.pt")
    _load_into(t.scheduler.load_state_dict, payload["scheduler"], where / "scheduler.pt")
    t.step = state["step"]
    t.samples_seen = state["samples_seen"]
    t.skipped_steps = state["skipped_steps"]
    t.last_loss = state.get("last_loss")
    saved_scale = _batch_scale(state, where)
    vars(t.batch_scale).update(vars(saved_scale))  # in place: the scheduler holds this object
    if state["world_size"] != t.world_size or state["global_batch"] != t.global_batch:
        _resplit(t, state, where)
    _load_into(
        lambda s: t.sampler.load_state_dict(s, regroup=t.global_batch != state["global_batch"]),
        payload["sampler"],
        where / "sampler.pt",
    )
    if t.global_batch != state["global_batch"]:
        t.batch_scale.retarget(
            t.global_batch / cfg.global_batch, t.scheduler.last_epoch, cfg.rescale_warmup_steps
        )
    sync_lr(t.scheduler)
    t.total_steps = t.plan_total_steps()
    _load_comm_hook(t, payload.get("comm_hook"), where / "comm_hook.pt")
    rngs = payload["rng"].get("ranks") if isinstance(payload["rng"], dict) else None
    if not rngs:
        raise CheckpointError(f"checkpoint {where / 'rng.pt'} holds no RNG states")
    # a restart with more workers than before: ranks beyond the old world reuse a saved stream
    restore_rng_state(rngs[t.rank % len(rngs)])
    t.resumed_from = t.step
    t.last_checkpoint = str(where)
    if t.rank == 0 and state["world_size"] != t.world_size:
        _report_resplit(t, state)


def _resplit(t: Trainer, state: dict, where: Path) -> None:
    """Split the batch for this world size: keep the global batch, or each worker's batch (scale-lr)."""
    old_world, old_g = state["world_size"], state["global_batch"]
    old_micro, old_k = state.get("micro_batch"), state.get("accumulation_steps")
    saved_split = all(isinstance(v, int) and v > 0 for v in (old_micro, old_k))
    if t.cfg.world_change == "scale-lr":
        # a worker's batch is the configured global batch over the first world size, never more
        per_worker = old_micro * old_k if saved_split else 0
        if not saved_split or per_worker * old_world != old_g or per_worker > t.cfg.global_batch:
            raise CheckpointError(
                f"checkpoint {where / 'trainer.pt'}: micro_batch {old_micro!r} x accumulation_steps "
                f"{old_k!r} x world_size {old_world} is not its global batch {old_g}, or a worker's batch "
                f"exceeds the configured global batch {t.cfg.global_batch}; the file is corrupt"
            )
        t.set_batch_split(old_micro, old_k)
    elif saved_split and t.global_batch % (t.world_size * old_micro) == 0:
        t.set_batch_split(old_micro, t.global_batch // (t.world_size * old_micro))
    # else: keep the split resolve_batch made from the configuration for this world size


def _report_resplit(t: Trainer, state: dict) -> None:
    old_world, old_g = state["world_size"], state["global_batch"]
    old_micro, old_k = state.get("micro_batch"), state.get("accumulation_steps")
    if t.global_batch == old_g:
        how = (
            f"global batch {old_g} kept; micro-batch {old_micro} -> {t.micro_batch}, accumulation steps "
            f"{old_k} -> {t.accumulation_steps}; results match the uninterrupted run up to "
            "floating-point summation order"
        )
    else:
        s, c, base = t.batch_scale, t.scheduler.last_epoch, t.scheduler.base_lrs[0]
        lr_from = base * lr_factor(t.cfg, c) * s.start
        lr_to = base * lr_factor(t.cfg, c + s.steps) * s.target
        how = (
            f"per-worker batch {old_micro} x {old_k} kept; global batch {old_g} -> {t.global_batch}; "
            f"learning rate x{s.target / s.start:.4g} by the linear scaling rule ({lr_from:.4g} -> "
            f"{lr_to:.4g} over {s.steps} steps); the run ends at step {t.total_steps} to keep its "
            "sample budget"
        )
    print(
        f"dpscale: checkpoint written by {old_world} workers, resuming with {t.world_size}: {how}",
        file=sys.stderr,
        flush=True,
    )


def _batch_scale(state: dict, where: Path) -> BatchScale:
    try:
        return BatchScale.from_dict(state.get("batch_scale", BatchScale().to_dict()))
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"checkpoint {where / 'trainer.pt'}: {e}") from None


def _load_comm_hook(t: Trainer, saved: object, path: Path) -> None:
    """Give the hook its saved state: this rank's at the same world size, the ranks' mean otherwise."""
    if t.comm_state is None or saved is None:
        return  # no hook now, or none then: a PowerSGD run starts its uncompressed steps afresh
    if not isinstance(saved, dict) or not isinstance(saved.get("ranks"), list) or not saved["ranks"]:
        raise CheckpointError(f"checkpoint {path} holds no per-rank hook states")
    if saved.get("compression") != t.cfg.compression:
        return  # another compression then: its state means nothing to this hook
    ranks = saved["ranks"]
    try:
        mine = ranks[t.rank] if len(ranks) == t.world_size else type(t.comm_state).merge_rank_states(ranks)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {path} does not fit this run: {e}") from None
    _load_into(lambda s: t.comm_state.load_state_dict(s, t.model.module.named_parameters()), mine, path)


def _trainer_state(state: object, where: Path) -> dict:
    # the file passed its checksum, but the manifest is no signature: check what the loop relies on
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {where / 'trainer.pt'} holds a {type(state).__name__}, not a dict")
    # written before world_change existed: the global batch never changed
    state = {"base_global_batch": state.get("global_batch"), **state}
    for key in _COUNTS:
        value = state.get(key)
        if type(value) is not int or value < 0 or (key in _POSITIVE and value < 1):
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
