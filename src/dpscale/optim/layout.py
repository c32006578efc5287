"""Where each parameter and each rank's shard sit in the flat parameter vector, and moving state across.

All trainable parameters are laid end to end, parameter group after parameter group, in one flat
vector padded to a multiple of the world size; rank r owns the r-th of W equal contiguous parts
(`chunk_bounds`). A shard cuts across parameter boundaries; the wrapped optimizer sees one tensor,
a *piece*, per parameter that the shard overlaps (and one for padding, if the shard has some). Not
one tensor per shard: element-wise optimizers allocate temporaries the size of the tensor they
update, and pieces keep those as small as with the unsharded optimizer.

The functions below translate optimizer state between the per-piece form the ranks hold and
torch's per-parameter form (`Optimizer.state_dict()`), which is what checkpoints store. State comes
in two kinds. Element state (Adam's exp_avg, SGD's momentum_buffer) has one value per parameter
element and is cut and joined like the parameters. Scalar state (Adam's step) is one value per
parameter, and each piece of a parameter holds a copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dpscale.comm.base import chunk_bounds


@dataclass(frozen=True)
class Piece:
    """[lo, hi) of the flat vector: inside parameter `param` (None: padding) and inside one shard."""

    param: int | None
    group: int
    lo: int
    hi: int


@dataclass(frozen=True)
class FlatLayout:
    """Offsets in the flat vector: parameter i at [offsets[i], offsets[i] + numels[i])."""

    offsets: list[int]
    numels: list[int]
    groups: list[int]  # the parameter group of each parameter
    numel: int  # all parameters
    padded_numel: int  # a multiple of world_size, at least world_size
    world_size: int

    @classmethod
    def build(cls, group_params: list[list[torch.Tensor]], world_size: int) -> FlatLayout:
        offsets, numels, groups, off = [], [], [], 0
        for g, params in enumerate(group_params):
            for p in params:
                offsets.append(off)
                numels.append(p.numel())
                groups.append(g)
                off += p.numel()
        # padded so every rank owns the same number of elements: all-gather needs equal parts
        padded = max(world_size, -(-off // world_size) * world_size)
        return cls(offsets, numels, groups, off, padded, world_size)

    def shard(self, rank: int) -> tuple[int, int]:
        return chunk_bounds(self.padded_numel, self.world_size, rank)

    def pieces(self, rank: int) -> list[Piece]:
        lo, hi = self.shard(rank)
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels, strict=True)):
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                out.append(Piece(i, self.groups[i], a, b))
        if hi > self.numel:
            # Padding gets updated too (zero gradient: it stays zero), so that a rank whose shard
            # is all padding still has something to give its optimizer.
            out.append(Piece(None, self.groups[-1], max(lo, self.numel), hi))
        return out


def is_element_state(value: Any, piece_numel: int) -> bool:
    """Whether a wrapped optimizer's state entry for a piece of `piece_numel` elements is per element."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == piece_numel


def element_keys(full_state: dict[int, dict], shapes: list[torch.Size]) -> set[str]:
    """Keys of per-parameter state (torch's form) that are element state.

    A key is element state when its value has the shape of its parameter for some parameter that is
    not 0-dim: for a 0-dim parameter a per-element value and a scalar look alike, so its keys are
    classified by the other parameters.
    """
    keys = set()
    for i, state in full_state.items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and len(shapes[i]) > 0 and v.shape == shapes[i]:
                keys.add(k)
    return keys


def piece_state(
    layout: FlatLayout, piece: Piece, full_state: dict[int, dict], elements: set[str], like: torch.Tensor
) -> dict[str, Any]:
    """The wrapped optimizer's state for `piece`, cut from per-parameter state (parameter index -> dict).

    Padding gets none: the wrapped optimizer initializes it at its next step, as for a fresh tensor.
    `like` gives the device and the floating dtype of element state.
    """
    if piece.param is None:
        return {}
    off = layout.offsets[piece.param]
    out: dict[str, Any] = {}
    for k, v in full_state.get(piece.param, {}).items():
        if k in elements:
            dtype = like.dtype if v.is_floating_point() else v.dtype
            out[k] = v.reshape(-1)[piece.lo - off : piece.hi - off].to(
                device=like.device, dtype=dtype, copy=True
            )
        else:
            out[k] = v.clone() if isinstance(v, torch.Tensor) else v
    return out
