"""`TrainStates`: the named Stateful objects of a training run, into a checkpoint and back.

A checkpoint holds the named states of `shared()` from rank 0 plus each rank's own
(`per_rank()`: RNG streams, a comm hook's error feedback); `Checkpointer` (checkpointer.py) runs
the collective protocol and knows nothing of these objects. Loading puts the states back; fitting
the run to another world size (resume.py's plan) is the trainer's, which owns the sampler.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from dpscale.engine.collective_log import CollectiveLog
from dpscale.train.adaptive.auto_batch import GrowBatch
from dpscale.train.adaptive.noise_meter import NoiseScaleMeter
from dpscale.train.callbacks import TrainerCallback
from dpscale.train.checkpoint.checkpointer import Checkpointer, load_into
from dpscale.train.checkpoint.files import CheckpointError, LoadedCheckpoint
from dpscale.train.checkpoint.rank_state import HookState, RngState
from dpscale.train.device import Precision
from dpscale.train.state import TrainState

if TYPE_CHECKING:
    # torch.distributed.checkpoint costs ~1 s of import time in every process (workers, the CLI):
    # the protocol is only an annotation here
    from torch.distributed.checkpoint.stateful import Stateful

# what `shared()` names, in the order the files are written
SHARED = ("model", "optimizer", "scheduler", "sampler", "trainer")


class TrainStates:
    """The run's objects a checkpoint saves, by name; `sampler` is passed in on each call because a
    resume at another world size replaces it."""

    def __init__(
        self,
        *,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        state: TrainState,
        precision: Precision,
        noise_scale: NoiseScaleMeter,
        growth: GrowBatch | None,
        comm_state: Any,
        compression: str,
        group: dist.ProcessGroup | None,
        log: CollectiveLog,
        callbacks: Sequence[TrainerCallback],
        directory: str | None,
        keep_last: int,
        run_id: str | None = None,
    ):
        """`comm_state`: the comm hook's state (PowerSGD's Qs and errors), None for stateless hooks;
        `directory`: where checkpoints go, None when the run saves none; `run_id`: the run they
        belong to (Checkpointer)."""
        self.module, self.optimizer, self.scheduler = module, optimizer, scheduler
        self.state, self.precision, self.noise_scale, self.growth = state, precision, noise_scale, growth
        self.comm_state, self.compression = comm_state, compression
        self.group, self.log, self.callbacks = group, log, callbacks
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.checkpointer = self._checkpointer(directory, keep_last, run_id) if directory else None

    def shared(self, sampler: Stateful) -> dict[str, Stateful]:
        """The named objects a checkpoint saves from rank 0."""
        objects: tuple[Stateful, ...] = (self.module, self.optimizer, self.scheduler, sampler, self.state)
        return dict(zip(SHARED, objects, strict=True))

    def per_rank(self, rng_before_prefetch: dict | None = None) -> dict[str, Stateful]:
        """Each rank's own states: its RNG streams (with those a pending prefetch loaded under) and
        (PowerSGD) its hook's error feedback."""
        states: dict[str, Stateful] = {"rng": RngState(rng_before_prefetch)}
        if self.comm_state is not None:
            states["comm_hook"] = HookState(self.comm_state, self.module)
        return states

    def _checkpointer(self, directory: str, keep_last: int, run_id: str | None) -> Checkpointer:
        def on_file(step: int, stem: str) -> None:
            for c in self.callbacks:
                c.on_checkpoint_file(step, stem)

        return Checkpointer(
            directory,
            group=self.group,
            log=self.log,
            keep_last=keep_last,
            expected_stems=(*SHARED, "rng"),  # a hook's state is there only with a hook
            on_file=on_file,
            run_id=run_id,
        )

    def save(self, sampler: Stateful, rng_before_prefetch: dict | None = None) -> str:
        """Collective: rank 0 writes this step's checkpoint; all learn the path. `rng_before_prefetch`:
        the RNGs the next step was loaded under ahead of time (train/batches.py), None if it was not."""
        assert self.checkpointer is not None, "the trainer saves only with a checkpoint_dir"
        self.state.grad_scaler = self.precision.state_dict()
        self.state.noise_scale = self.noise_scale.state_dict()
        self.state.batch_growth = self.growth.state_dict() if self.growth else {}
        extra = {"comm_hook": {"compression": self.compression}}
        per_rank = self.per_rank(rng_before_prefetch)
        return self.checkpointer.save(self.state.step, self.shared(sampler), per_rank, extra)

    def resume(
        self, apply: Callable[[LoadedCheckpoint], None], trusted: dict[str, Any] | None = None
    ) -> str | None:
        """Collective: `apply` the newest checkpoint that verifies; its path, None for a fresh start."""
        assert self.checkpointer is not None, "config validation: resume needs checkpoint_dir"
        return self.checkpointer.resume(apply, trusted)

    def load_progress(self, payload: dict, saved: TrainState, where: Path) -> None:
        """The model, optimizer (with fp16's loss scale), scheduler, the loop's counters and the
        noise scale's sums, from a checkpoint whose trainer.pt is `saved`."""
        # the scheduler last, once the model and optimizer are known to fit: its rates are checked
        for name, obj in (("model", self.module), ("optimizer", self.optimizer)):
            load_into(obj.load_state_dict, payload[name], where / f"{name}.pt")
            if name == "optimizer":  # the loss scale with the optimizer state it scaled
                load_into(self.precision.load_state_dict, saved.grad_scaler, where / "trainer.pt")
        _check_same_lr(self.scheduler.base_lrs, payload["scheduler"], where)
        load_into(self.scheduler.load_state_dict, payload["scheduler"], where / "scheduler.pt")
        state = self.state
        state.step, state.samples_seen = saved.step, saved.samples_seen
        state.skipped_steps, state.last_loss = saved.skipped_steps, saved.last_loss
        state.batch_changed = saved.batch_changed  # max_steps stays a budget in samples once it moved
        state.batch_scale.load_state_dict(saved.batch_scale.state_dict())  # in place: the scheduler holds it
        load_into(self.noise_scale.load_state_dict, saved.noise_scale, where / "trainer.pt")

    def load_per_rank(self, payload: dict, where: Path) -> dict | None:
        """This rank's hook state and RNG streams; at another world size, as rank_state.py says.
        Returns the RNGs the saved run's pending prefetch loaded under (None: none was pending)."""
        if self.comm_state is not None:
            HookState(self.comm_state, self.module).load_saved(
                payload.get("comm_hook"),
                self.compression,
                self.rank,
                self.world_size,
                where / "comm_hook.pt",
            )
        rngs = payload["rng"].get("ranks") if isinstance(payload["rng"], dict) else None
        if not rngs:
            raise CheckpointError(f"checkpoint {where / 'rng.pt'} holds no RNG states")
        # a restart with more workers than before: ranks beyond the old world reuse a saved stream
        rng = RngState()
        load_into(rng.load_state_dict, rngs[self.rank % len(rngs)], where / "rng.pt")
        return rng.before_prefetch


def _check_same_lr(configured: list, saved_scheduler: object, where: Path) -> None:
    """A resume continues the saved schedule, whose base rates would silently replace the
    configured ones: a run that asks for another rate is refused instead of ignored."""
    saved = saved_scheduler.get("base_lrs") if isinstance(saved_scheduler, dict) else None
    if not isinstance(saved, list) or len(saved) != len(configured) or saved == configured:
        return  # a malformed state is load_into's to report
    raise CheckpointError(
        f"lr: checkpoint {where} was trained with lr {_rates(saved)}, and this run asks for "
        f"{_rates(configured)}; a resume continues the saved schedule: give lr {_rates(saved)}, "
        "or start_over (--start-over) for a new run"
    )


def _rates(lrs: list) -> str:
    return ", ".join(
        f"{lr:g}" if isinstance(lr, float | int) else repr(lr) for lr in sorted(set(lrs), key=str)
    )
