"""Per-rank states as Stateful objects: each rank's RNG streams and its comm hook's state.

Unlike the model or the optimizer these differ between ranks, so the checkpoint manager gathers
them to rank 0 and saves one per rank. At another world size a rank has no state of its own in the
checkpoint: RNG streams are reused round-robin (trainer.py), and a hook starts from the ranks' mean
(`HookState.load_saved`), which keeps PowerSGD's pending correction.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from .checkpoint import CheckpointError, capture_rng_state, restore_rng_state
from .checkpointer import load_into


class RngState:
    """This process's random number generators (Python, NumPy, torch CPU and CUDA)."""

    def state_dict(self) -> dict:
        return capture_rng_state()

    def load_state_dict(self, state: dict) -> None:
        restore_rng_state(state)


class HookState:
    """A comm hook's state (PowerSGD's Qs and error feedback) over `module`'s parameters."""

    def __init__(self, hook_state, module: nn.Module):
        self.hook_state, self.module = hook_state, module

    def state_dict(self) -> dict:
        return self.hook_state.state_dict(self.module.named_parameters())

    def load_state_dict(self, state: dict) -> None:
        self.hook_state.load_state_dict(state, self.module.named_parameters())

    def load_saved(self, saved: object, compression: str, rank: int, world_size: int, path: Path) -> None:
        """Load a checkpoint's comm_hook entry: this rank's state at the same world size, the ranks'
        mean otherwise; nothing when the checkpoint has none or is of another compression."""
        if saved is None:
            return  # no hook then: a PowerSGD run starts its uncompressed steps afresh
        if not isinstance(saved, dict) or not isinstance(saved.get("ranks"), list) or not saved["ranks"]:
            raise CheckpointError(f"checkpoint {path} holds no per-rank hook states")
        if saved.get("compression") != compression:
            return  # another compression then: its state means nothing to this hook
        ranks = saved["ranks"]
        try:
            mine = ranks[rank] if len(ranks) == world_size else type(self.hook_state).merge_rank_states(ranks)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {path} does not fit this run: {e}") from None
        load_into(self.load_state_dict, mine, path)
