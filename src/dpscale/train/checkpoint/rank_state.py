"""Per-rank states as Stateful objects: each rank's RNG streams and its comm hook's state.

Unlike the model or the optimizer these differ between ranks, so the checkpoint manager gathers
them to rank 0 and saves one per rank. At another world size a rank has no state of its own in the
checkpoint: RNG streams are reused round-robin (trainer.py), and a hook starts from the ranks' mean
(`HookState.load_saved`), which keeps PowerSGD's pending correction. `capture_rng_state` and
`restore_rng_state` read and set the generators themselves, in a form torch.load(weights_only) takes.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dpscale.errors import ConfigError
from dpscale.train.checkpoint.checkpointer import load_into
from dpscale.train.checkpoint.files import CheckpointError, CheckpointWarning

PREFETCH_KEY = "before_prefetch"
"""The entry of a saved RNG state that holds the RNGs a pending prefetch loaded under (batches.py)."""


class RngState:
    """This process's random number generators (Python, NumPy, torch CPU and CUDA), and beside them
    the ones the trainer's pending prefetch loaded the next step under (`before_prefetch`), which
    a resumed run loads that step under again (train/batches.py)."""

    def __init__(self, before_prefetch: dict[str, Any] | None = None):
        self.before_prefetch = before_prefetch

    def state_dict(self) -> dict:
        state = capture_rng_state()
        if self.before_prefetch is not None:
            state[PREFETCH_KEY] = self.before_prefetch
        return state

    def load_state_dict(self, state: dict) -> None:
        before = state.get(PREFETCH_KEY)
        # checkpoints written before it was saved have none: the step is then loaded as it comes
        if before is not None and not (isinstance(before, dict) and _RNG_KEYS <= before.keys()):
            raise ConfigError(
                f"RNG state's {PREFETCH_KEY!r} entry is not an RNG state from capture_rng_state()"
            )
        restore_rng_state(state)
        self.before_prefetch = before


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


def capture_rng_state() -> dict[str, Any]:
    """This process's torch (and initialized CUDA), numpy-global and `random` states, weights_only-safe."""
    legacy = np.random.get_state(legacy=True)
    assert isinstance(legacy, tuple), "legacy=True gives the MT19937 tuple"
    bit_generator, key, pos, has_gauss, cached_gaussian = legacy
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        # uint32 key as int64: every value fits and int64 tensors round-trip everywhere
        "numpy": {
            "bit_generator": bit_generator,
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }
    # only if already initialized: querying would otherwise create a CUDA context in a CPU-only run.
    # Only this worker's GPU: the others' generators are other workers' (or nobody's), and a resume
    # on a host with another number of visible GPUs must still find this one
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


_RNG_KEYS = {"torch", "numpy", "python"}


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of `capture_rng_state`: the next numbers drawn equal those drawn after the capture."""
    for key in sorted(_RNG_KEYS):
        if key not in state:
            raise ConfigError(f"RNG state has no {key!r} entry; pass a dict from capture_rng_state()")
    torch.set_rng_state(state["torch"])
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["bit_generator"],
            np_state["key"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    py_state = state["python"]
    random.setstate((py_state["version"], tuple(py_state["internal"]), py_state["gauss_next"]))
    if "cuda" in state:
        _restore_cuda_rng(state["cuda"])


def _restore_cuda_rng(saved: torch.Tensor | list[torch.Tensor]) -> None:
    if not torch.cuda.is_available():
        # a GPU run resumed on CPU for debugging: its CUDA streams cannot be reproduced anyway
        warnings.warn(
            "RNG state has a CUDA generator but CUDA is unavailable; ignoring it",
            CheckpointWarning,
            stacklevel=3,
        )
        return
    if isinstance(saved, list | tuple):
        # older checkpoints held every visible GPU's generator: take this worker's
        current = torch.cuda.current_device()
        if current >= len(saved):
            raise ConfigError(
                f"RNG state has {len(saved)} CUDA generators and this worker's GPU is {current}; "
                "set CUDA_VISIBLE_DEVICES as in the run that saved it"
            )
        saved = saved[current]
    torch.cuda.set_rng_state(saved)
