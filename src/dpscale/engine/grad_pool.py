"""The small-gradient pool: `.grad` tensors for a bucket of small tensors, laid out as the bucket.

With gradient_as_bucket_view=False (torch's default) each `.grad` is a tensor of its own. For a
bucket of small tensors the reducer hands out views into one pool buffer (see
`Reducer._preset_grads`), so autograd accumulates into them with no allocation, the bucket takes
one copy of the pool at launch and the pool gets one copy of the reduced bucket back.
"""

from __future__ import annotations

import operator
import sys

import torch

from dpscale.engine.compat import torch_private


def zero_views(flat: torch.Tensor, views: list[torch.Tensor], positions: list[int]) -> None:
    """Zero `views[k]` for k in `positions`, all of `flat` in one call when that is every view."""
    if len(positions) == len(views):
        flat.zero_()
    else:
        for k in positions:
            views[k].zero_()


class GradPool:
    """gradient_as_bucket_view=False, a bucket of small tensors: the `.grad` tensors, views into
    one flat buffer laid out as the bucket. Autograd accumulates into them; the bucket gets one
    copy of the buffer at launch and gives one back after the reduction. Reused from step to
    step while nobody else holds a reference to one of them, so a step allocates nothing."""

    def __init__(self, buffer: torch.Tensor, offsets: list[int], views: list[torch.Tensor]):
        """A pool laid out as the bucket whose flat `buffer` holds `views` at `offsets`."""
        self.flat = torch.zeros_like(buffer)
        spans = zip(offsets, views, strict=True)
        self.views = [self.flat[o : o + v.numel()].view_as(v) for o, v in spans]
        self._storage_refs = torch_private.storage_use_count(self.flat)

    def free(self) -> bool:
        """Whether nobody else refers to a view (a view someone took of one counts too: it
        shares the storage). `.grad` pointing at a view adds no Python reference (autograd holds
        the tensor in C++); a user's `g = p.grad` does."""
        for view in self.views:
            # self.views, this loop's `view` and getrefcount's argument
            if sys.getrefcount(view) > 3:
                return False
        count = torch_private.storage_use_count(self.flat)
        return count is not None and count == self._storage_refs  # None: torch cannot tell

    def zeroed(self, missing: list[int]) -> GradPool:
        """This pool with the views at `missing` zeroed (the gradients autograd will accumulate
        into)."""
        zero_views(self.flat, self.views, missing)
        return self

    def gaps(self, grads: list[torch.Tensor | None]) -> list[int] | None:
        """Where `grads` (the bucket's `.grad`s, in bucket order) are None, if every other one is
        this pool's view at its place; None if some gradient is a tensor of its own."""
        if all(map(operator.is_, grads, self.views)):  # every step but odd ones: no loop in Python
            return []
        if all(g is None or g is v for g, v in zip(grads, self.views, strict=True)):
            return [k for k, g in enumerate(grads) if g is None]
        return None
