"""dpscale's steps in the user's own torch.profiler: named ranges beside torch's operators.

When a script runs under `torch.profiler.profile(...)`, the engine adds `record_function` ranges
for its forward, each bucket's reduction (launch to completion, which may end out of nesting
order: buckets overlap) and the exposed communication (the wait after backward); the Trainer adds
its data wait and optimizer step. They then show in the profiler's table and in the Chrome trace
it exports, on the thread that ran them. Whether a profiler records is asked once per forward
(compat/torch_private.py): with none, no range is made and the step runs as without this module.
"""

from __future__ import annotations

from torch.autograd.profiler import record_function

from dpscale.engine.compat.torch_private import profiler_enabled

__all__ = ["PREFIX", "open_range", "close_range", "profiler_enabled", "bucket_range_name"]

PREFIX = "dpscale: "
FORWARD = PREFIX + "forward"
EXPOSED_COMM = PREFIX + "exposed communication"
DATA_WAIT = PREFIX + "data wait"
OPTIMIZER = PREFIX + "optimizer"


def bucket_range_name(index: int) -> str:
    return f"{PREFIX}bucket {index} reduction"


def open_range(name: str) -> record_function:
    """A range that begins now and ends at `close_range`, in any order relative to other ranges."""
    r = record_function(name)
    r.__enter__()
    return r


def close_range(r: record_function) -> None:
    r.__exit__(None, None, None)
