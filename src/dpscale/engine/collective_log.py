"""What a rank last asked of the others: a ring log of collectives, and errors that use it.

Collectives are matched by issue order across ranks, so most distributed hangs are one of two
things: a rank that stopped issuing (dead, stuck, slow) or ranks issuing different collectives
(a branch on rank, different models or settings). Each rank records every collective the engine
and trainer issue (sequence number, operation, bucket, numel, dtype) in a short ring. With
`verify` on, every record is first compared across ranks through one tiny all-gather, which
names both sides of a mismatch before the mismatched collective can hang or corrupt data; the
trainer turns it on for its first step only, where a mismatch would first show. When a
collective fails, `explain_failures` asks the other ranks through the process group's store
(which survives a timed-out collective) what they last issued, names the ranks that did not
answer, and appends this rank's ring.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from dpscale.comm.attempt import attempt_id, describe_rank, host_key, within
from dpscale.comm.base import all_gather_into
from dpscale.comm.group_device import collective_device
from dpscale.engine.compat import torch_private

OPS = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_object",
    "broadcast_object",
    "comm_hook",
    "gather_object",
)
# dtypes the verify message can name; anything else is compared as "other"
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8)
# how long past the report wait a failing rank may spend on the store before it gives up on it
STORE_MARGIN_S = 5.0
# what gloo, the TCP store and the shm transport say when a peer is gone or late
_COMM_FAILURE = re.compile(
    r"timed out|timeout|connection (closed|reset)|broken pipe|waited .* for rank", re.IGNORECASE
)


class CollectiveMismatchError(RuntimeError):
    """Ranks were about to issue different collectives; names both."""


class CollectiveError(RuntimeError):
    """A collective timed out or lost a peer; says which ranks answered and what this one issued.

    `silent_ranks`: the ranks that did not report in time (dead or hung), for the launcher's summary.
    """

    def __init__(self, message: str, silent_ranks: list[int] | None = None):
        super().__init__(message)
        self.silent_ranks = list(silent_ranks or [])


@dataclass(frozen=True)
class CollectiveRecord:
    seq: int
    op: str
    what: str  # "bucket 3", "step flags", ...: for people; not compared
    numel: int  # 0 for object collectives, whose pickled size legitimately differs
    dtype: str
    bucket: int = -1

    def __str__(self) -> str:
        size = f"{self.numel} x {self.dtype}" if self.numel else "python objects"
        return f"#{self.seq} {self.op} of {self.what} ({size})"


class CollectiveLog:
    """The last `capacity` collectives this rank issued over `process_group`, oldest first."""

    def __init__(self, process_group: dist.ProcessGroup | None = None, capacity: int = 16):
        self.group = process_group
        self.seq = 0
        self.verify = False
        self._ring: deque[CollectiveRecord] = deque(maxlen=capacity)

    def record(
        self, op: str, what: str, tensor: torch.Tensor | None = None, *, bucket: int = -1
    ) -> CollectiveRecord:
        """Log the collective about to be issued (call it first, so a hang shows it)."""
        assert op in OPS, op
        self.seq += 1
        numel = tensor.numel() if tensor is not None else 0
        dtype = str(tensor.dtype).removeprefix("torch.") if tensor is not None else "object"
        rec = CollectiveRecord(self.seq, op, what, numel, dtype, bucket)
        self._ring.append(rec)
        if self.verify:
            self._agree(rec)
        return rec

    def records(self) -> list[CollectiveRecord]:
        return list(self._ring)

    def describe(self, last: int = 6) -> str:
        recs = self.records()[-last:]
        return "; ".join(map(str, recs)) if recs else "nothing yet"

    def _agree(self, rec: CollectiveRecord) -> None:
        dtype = next((i for i, d in enumerate(_DTYPES) if str(d).endswith("." + rec.dtype)), -1)
        # on the group's device, not the record's tensor's: object collectives and sparse
        # gradients have none on a device NCCL takes
        device = collective_device(self.group)
        mine = torch.tensor([rec.seq, OPS.index(rec.op), rec.bucket, rec.numel, dtype], device=device)
        world = dist.get_world_size(self.group)
        gathered = torch.empty(world, mine.numel(), dtype=mine.dtype, device=device)
        all_gather_into(gathered, mine, self.group)
        rows = gathered.tolist()  # one trip to the host
        me = dist.get_rank(self.group)
        for rank, row in enumerate(rows):
            if row != rows[0]:
                raise CollectiveMismatchError(
                    f"ranks issue different collectives: rank 0 issues {_describe_row(rows[0])}, "
                    f"rank {rank} issues {_describe_row(row)} (this is rank {me}); every rank must issue "
                    "the same collectives in the same order: look for a branch on the rank, or a setting "
                    "(bucket_cap_mb, a comm hook, the model) that differs between ranks"
                )


def _describe_row(row: list[int]) -> str:
    seq, op, bucket, numel, dtype = row
    where = f" of bucket {bucket}" if bucket >= 0 else ""
    kind = str(_DTYPES[dtype]).removeprefix("torch.") if dtype >= 0 else "other"
    size = f"{numel} x {kind}" if numel else "python objects"
    return f"#{seq} {OPS[op]}{where} ({size})"


def is_comm_failure(exc: BaseException) -> bool:
    """Whether `exc` says a collective timed out or lost a peer (not a bug in this rank's code)."""
    if isinstance(exc, CollectiveError | CollectiveMismatchError):
        return False  # already explained
    dist_error = getattr(dist, "DistError", ())
    if dist_error and isinstance(exc, dist_error):
        return True
    return isinstance(exc, RuntimeError) and bool(_COMM_FAILURE.search(str(exc)))


@contextmanager
def explain_failures(log: CollectiveLog, wait_s: float) -> Iterator[None]:
    """Turn a timed-out or broken collective inside the block into a `CollectiveError` that names
    the ranks that did not answer within `wait_s` and this rank's last collectives."""
    try:
        yield
    except Exception as e:
        if not is_comm_failure(e):
            raise
        message, silent = _explain(e, log, wait_s)
        raise CollectiveError(message, silent) from e


def _explain(exc: Exception, log: CollectiveLog, wait_s: float) -> tuple[str, list[int]]:
    me = dist.get_rank(log.group)
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    lines = [f"rank {me}: a collective failed ({type(exc).__name__}: {first_line[:300]})"]
    last = log.records()[-1] if log.records() else None
    mine = asdict(last) if last else None
    answers = _ask_peers(log, mine, wait_s)
    missing: list[int] = []
    if answers is None:
        lines.append("could not ask the other ranks (no store); see their own logs")
    elif not answers.reached:
        lines.append(
            f"could not ask the other ranks: the store at {_store_host()} did not answer within "
            f"{wait_s + STORE_MARGIN_S:.0f} s (its host is gone or cut off from this one); see their own logs"
        )
    else:
        reports = answers.reports
        missing = [r for r in range(dist.get_world_size(log.group)) if r not in reports]
        if missing:
            who = ", ".join(describe_rank(r, answers.hosts.get(r)) for r in missing)
            lines.append(
                f"{who} did not report within {wait_s:.0f} s: dead, hung, or blocked outside the "
                "collectives dpscale issues; that is the rank to look at"
            )
        for r, rep in sorted(reports.items()):
            if r != me and rep != mine:
                other = str(CollectiveRecord(**rep)) if rep else "nothing"
                lines.append(f"rank {r} also failed; it last issued {other}")
    lines.append(f"this rank last issued (oldest first): {log.describe()}")
    return "\n".join(lines), missing


def _store_host() -> str:
    # where the workers' store is, as the agent (or torchrun) told this worker
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"


def _ask_peers(log: CollectiveLog, mine: dict | None, wait_s: float) -> _PeerAnswers | None:
    """Publish this rank's last record in the store; collect those of the ranks that answer in time.

    Returns the answers (and where the silent ranks run, when the store still knows); None without a
    store. Returns within `wait_s` + `STORE_MARGIN_S` even when the store is unreachable.
    """
    try:
        store = torch_private.default_store()
        members = dist.get_process_group_ranks(log.group or dist.group.WORLD)
    except Exception:  # a private API (TorchPrivateError), absent without a default group: best effort
        return None
    me = dist.get_rank(log.group)
    # keys unique per attempt and equal on every host of it (see comm/attempt.py), by global rank
    key = f"dpscale/failed/{attempt_id()}/{{}}".format
    answers = _PeerAnswers()

    def ask() -> bool:
        store.set(key(members[me]), json.dumps(mine))
        # a set can return with the store's host unreachable (the request only has to be sent):
        # reading this rank's own key back proves the store answers
        answers.reached = store.check([key(members[me])])
        deadline = time.monotonic() + wait_s
        while len(answers.reports) < len(members) and time.monotonic() <= deadline:
            for r, global_rank in enumerate(members):
                if r not in answers.reports and store.check([key(global_rank)]):
                    answers.reports[r] = json.loads(store.get(key(global_rank)))
            time.sleep(0.05)
        for r, global_rank in enumerate(members):
            if r not in answers.reports and store.check([host_key(global_rank)]):
                answers.hosts[r] = json.loads(store.get(host_key(global_rank)))
        return True

    # the store may be gone (the agent died) or cut off (no reply ever comes): never wait past this
    within(wait_s + STORE_MARGIN_S, ask, False)
    # copies: after the deadline the asking thread may still be blocked and add to these later
    return _PeerAnswers(answers.reached, dict(answers.reports), dict(answers.hosts))


@dataclass
class _PeerAnswers:
    reached: bool = False  # whether this rank could publish its own record at all
    reports: dict[int, dict | None] = field(default_factory=dict)  # group rank -> its last record
    hosts: dict[int, dict[str, str]] = field(default_factory=dict)  # silent group rank -> its host
