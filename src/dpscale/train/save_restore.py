"""The trainer's state in and out of checkpoints: named Stateful objects, save, resume.

`Trainer`'s checkpoint side (its state is set up in trainer.py). A checkpoint holds the named
states of `stateful()` from rank 0 plus each rank's own (`_rank_stateful()`: RNG streams, a comm
hook's error feedback); `Checkpointer` (checkpointer.py) runs the collective protocol and knows
nothing of trainer attributes. Loading also resumes at another world size, by resume.py's plan.
"""

from __future__ import annotations

from pathlib import Path

from dpscale.engine import DistributedDataParallel
from dpscale.log import get_logger
from dpscale.train.checkpoint.checkpointer import Checkpointer, Stateful, load_into
from dpscale.train.checkpoint.files import CheckpointError
from dpscale.train.checkpoint.rank_state import HookState, RngState
from dpscale.train.checkpoint.resume import BatchSplit, check_resumable, describe_resplit, plan_split
from dpscale.train.optim import sync_lr
from dpscale.train.state import TrainState

logger = get_logger(__name__)


class SaveRestore:
    """`stateful()`, `state_dict()`, `save_checkpoint()` and `load_state_dict()`, mixed into `Trainer`."""

    def stateful(self) -> dict[str, Stateful]:
        """The named objects a checkpoint saves from rank 0, each with state_dict/load_state_dict."""
        return {
            "model": self._module,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "sampler": self.sampler,
            "trainer": self.state,
        }

    def state_dict(self) -> dict:
        return {name: obj.state_dict() for name, obj in self.stateful().items()}

    def _rank_stateful(self) -> dict[str, Stateful]:
        """Each rank's own states: its RNG streams and (PowerSGD) its hook's error feedback."""
        states: dict[str, Stateful] = {"rng": RngState()}
        if self.comm_state is not None:
            states["comm_hook"] = HookState(self.comm_state, self._module)
        return states

    def _checkpointer(self) -> Checkpointer:
        def on_file(step: int, stem: str) -> None:
            for c in self.callbacks:
                c.on_checkpoint_file(step, stem)

        return Checkpointer(
            self.cfg.checkpoint_dir,
            group=self.group,
            log=self.log,
            keep_last=self.cfg.keep_checkpoints,
            expected_stems=(*self.stateful(), "rng"),  # a hook's state is there only with a hook
            on_file=on_file,
        )

    def save_checkpoint(self) -> str:
        """Collective: rank 0 writes this step's checkpoint; all learn the path."""
        self.state.grad_scaler = self.precision.state_dict()
        self.state.noise_scale = self.noise_scale.state_dict()
        self.state.batch_growth = self._growth.state_dict() if self._growth else {}
        extra = {"comm_hook": {"compression": self.cfg.compression}}
        self.last_checkpoint = self._checkpointer().save(
            self.step, self.stateful(), self._rank_stateful(), extra
        )
        return self.last_checkpoint

    def _resume(self) -> None:
        """Collective: continue from the newest checkpoint that verifies; a fresh start if there is none."""
        saved: list[TrainState] = []
        path = self._checkpointer().resume(
            lambda ckpt: saved.append(self.load_state_dict(ckpt.payload, ckpt.path))
        )
        if path is None:
            return
        self.resumed_from, self.last_checkpoint = self.step, path
        if self.rank == 0 and saved[0].world_size != self.world_size:
            old, s = saved[0], self.scheduler
            logger.info(
                "%s",
                describe_resplit(old, self.state, self.cfg, s.last_epoch, s.base_lrs[0], self.total_steps),
            )

    def load_state_dict(self, payload: dict, where: Path | str = "checkpoint") -> TrainState:
        """Continue from a checkpoint's states (`stateful()`'s and `_rank_stateful()`'s names), also at
        another world size (resume.py's plan); returns the saved TrainState."""
        cfg, where = self.cfg, Path(where)
        saved = TrainState.from_state_dict(payload["trainer"], where / "trainer.pt")
        auto = self._growth is not None
        check_resumable(
            saved, global_batch=cfg.global_batch, world_change=cfg.world_change, where=where, auto_batch=auto
        )
        for name in ("model", "optimizer", "scheduler"):
            load_into(self.stateful()[name].load_state_dict, payload[name], where / f"{name}.pt")
            if name == "optimizer":  # the loss scale with the optimizer state it scaled
                load_into(self.precision.load_state_dict, saved.grad_scaler, where / "trainer.pt")
        state = self.state
        state.step, state.samples_seen = saved.step, saved.samples_seen
        state.skipped_steps, state.last_loss = saved.skipped_steps, saved.last_loss
        state.batch_changed = saved.batch_changed  # max_steps stays a budget in samples once it moved
        state.batch_scale.load_state_dict(saved.batch_scale.state_dict())  # in place: the scheduler holds it
        load_into(self.noise_scale.load_state_dict, saved.noise_scale, where / "trainer.pt")
        if isinstance(self.model, DistributedDataParallel):  # one synced backward per step
            self.model.set_synced_steps(saved.step)
        current = BatchSplit(state.micro_batch, state.accumulation_steps)
        split = plan_split(
            saved,
            world_size=self.world_size,
            current=current,
            global_batch=state.global_batch,
            configured_global_batch=cfg.global_batch,
            world_change=cfg.world_change,
            split_given=cfg.micro_batch is not None or cfg.accumulation_steps is not None,
            where=where / "trainer.pt",
            auto_batch=auto,
        )
        if split != current:
            self.set_batch_split(split.micro_batch, split.accumulation_steps)
        regroup = state.global_batch != saved.global_batch
        if auto:
            load_into(
                lambda s: self._growth.load_state_dict(s, same_world=saved.world_size == self.world_size),
                saved.batch_growth or {"changes": [], "fastest_s": {}},  # a fixed-batch run's: starts growing
                where / "trainer.pt",
            )
            if regroup:  # the grown batch does not split over this world size: back to the start
                self._growth.changes.append((saved.step, state.global_batch))
        load_into(
            lambda s: self.sampler.load_state_dict(s, regroup=regroup),
            payload["sampler"],
            where / "sampler.pt",
        )
        if regroup and not auto:  # scale-lr's linear rule; a growing batch's rate is AdaScale's
            state.batch_scale.retarget(
                state.global_batch / cfg.global_batch, self.scheduler.last_epoch, cfg.rescale_warmup_steps
            )
        sync_lr(self.scheduler)
        self.total_steps = self.plan_total_steps()
        if self.comm_state is not None:
            HookState(self.comm_state, self._module).load_saved(
                payload.get("comm_hook"),
                self.cfg.compression,
                self.rank,
                self.world_size,
                where / "comm_hook.pt",
            )
        rngs = payload["rng"].get("ranks") if isinstance(payload["rng"], dict) else None
        if not rngs:
            raise CheckpointError(f"checkpoint {where / 'rng.pt'} holds no RNG states")
        # a restart with more workers than before: ranks beyond the old world reuse a saved stream
        RngState().load_state_dict(rngs[self.rank % len(rngs)])
        return saved
