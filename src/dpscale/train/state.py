"""`TrainState`: the training loop's progress in one dataclass, saved as a checkpoint's trainer.pt.

Everything a resume needs besides the model, optimizer, scheduler, sampler, hook and RNG states
(each of which has its own `state_dict()`): steps taken, samples seen, skipped steps, the last
loss, the noise-scale estimate's sums, how the global batch is split over workers and
micro-batches, the LR multiplier of a world-size change (`BatchScale`) and how a growing batch
(--global-batch auto) has moved. The checkpoint
manager saves it as one named state among the others; `from_state_dict` checks what the loop
relies on, since a manifest's checksum proves only that a file is what the writer listed, not that
the writer was dpscale.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dpscale.train.checkpoint.files import CheckpointError
from dpscale.train.optim import BatchScale

# trainer.pt entries that must be non-negative ints; anything else means a corrupt or foreign file
_COUNTS = ("step", "samples_seen", "skipped_steps", "world_size", "global_batch", "base_global_batch")
_POSITIVE = ("world_size", "global_batch", "base_global_batch")


@dataclass
class TrainState:
    world_size: int
    global_batch: int  # samples per step now; differs from base_global_batch after a scale-lr resume
    base_global_batch: int  # the configured global batch
    micro_batch: int | None  # None only in checkpoints written before the split was saved
    accumulation_steps: int | None
    step: int = 0  # optimizer steps done (skipped ones included)
    samples_seen: int = 0
    skipped_steps: int = 0
    last_loss: float | None = None
    batch_scale: BatchScale = field(default_factory=BatchScale)  # the LR multiplier of a world change
    # the global batch has differed from the configured one at some step (--global-batch auto, a
    # scale-lr resume): max_steps is then a budget in samples, even once the batch is back
    batch_changed: bool = False
    # fp16's loss scale and growth count (Precision.state_dict(), the same on every rank): kept in
    # trainer.pt, where checkpoints have held it since fp16 resumes were made exact
    grad_scaler: dict = field(default_factory=dict)
    # the gradient noise scale's smoothed sums (NoiseScaleMeter.state_dict(), the same on every
    # rank), so a resumed run continues the estimate exactly; empty in older checkpoints
    noise_scale: dict = field(default_factory=dict)
    # --global-batch auto's changes and step times (GrowBatch.state_dict(), the same on every rank);
    # empty for a fixed batch and in older checkpoints
    batch_growth: dict = field(default_factory=dict)

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "samples_seen": self.samples_seen,
            "skipped_steps": self.skipped_steps,
            "world_size": self.world_size,
            "global_batch": self.global_batch,
            "base_global_batch": self.base_global_batch,
            "batch_scale": self.batch_scale.state_dict(),
            "batch_changed": self.batch_changed,
            "micro_batch": self.micro_batch,
            "accumulation_steps": self.accumulation_steps,
            "last_loss": self.last_loss,
            "grad_scaler": self.grad_scaler,
            "noise_scale": self.noise_scale,
            "batch_growth": self.batch_growth,
        }

    def load_state_dict(self, state: object) -> None:
        """Take every field from `state` (a checkpoint's trainer.pt); the batch scale in place."""
        saved = TrainState.from_state_dict(state)
        self.batch_scale.load_state_dict(saved.batch_scale.state_dict())  # the scheduler holds this object
        vars(self).update({k: v for k, v in vars(saved).items() if k != "batch_scale"})

    @classmethod
    def from_state_dict(cls, state: object, where: Path | str = "trainer.pt") -> TrainState:
        """A checked TrainState; CheckpointError naming `where` when a value is not what dpscale writes."""
        if not isinstance(state, dict):
            raise CheckpointError(f"checkpoint {where} holds a {type(state).__name__}, not a dict")
        # written before world_change existed: the global batch never changed
        state = {"base_global_batch": state.get("global_batch"), **state}
        for key in _COUNTS:
            value = state.get(key)
            if type(value) is not int or value < 0 or (key in _POSITIVE and value < 1):
                raise CheckpointError(
                    f"checkpoint {where}: {key} is {value!r}, not a valid count; "
                    "the file is corrupt or was not written by dpscale"
                )
        if type(state.get("batch_changed", False)) is not bool:
            raise CheckpointError(
                f"checkpoint {where}: batch_changed is {state['batch_changed']!r}, not a bool; "
                "the file is corrupt or was not written by dpscale"
            )
        try:
            scale = BatchScale.from_dict(state.get("batch_scale", BatchScale().to_dict()))
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"checkpoint {where}: {e}") from None
        return cls(
            world_size=state["world_size"],
            global_batch=state["global_batch"],
            base_global_batch=state["base_global_batch"],
            micro_batch=state.get("micro_batch"),
            accumulation_steps=state.get("accumulation_steps"),
            step=state["step"],
            samples_seen=state["samples_seen"],
            skipped_steps=state["skipped_steps"],
            last_loss=state.get("last_loss"),
            batch_scale=scale,
            # older checkpoints: a batch that differs now, or a ramp behind it, is the change
            batch_changed=state.get(
                "batch_changed", state["global_batch"] != state["base_global_batch"] or scale != BatchScale()
            ),
            grad_scaler=state.get("grad_scaler", {}),
            noise_scale=state.get("noise_scale", {}),
            batch_growth=state.get("batch_growth", {}),
        )
