"""`dpscale train --trace DIR`: the loop's steps as a Chrome trace per rank (engine/trace.py).

The Trainer marks what `dpscale run` sees from outside a script (engine/telemetry.py): each
micro-batch's forward, the backward, the optimizer step; the engine's stats give the exposed
communication and each bucket's reduction. A step runs from its first forward to the next step's,
so its data wait (the next batch, the loop's metrics and checkpoints) comes last, as for `run`.
Only the window's steps are kept; steps are numbered as in metrics.jsonl (a resumed run goes on
from its checkpoint's step). At the end of the run the ranks exchange their traced steps'
times (one collective) so each file also shows the idle time behind the slowest rank, and every
rank writes its own rank<r>.trace.json.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from dpscale.engine.stats import StepStats
from dpscale.engine.telemetry import StepTelemetry, bucket_spans
from dpscale.engine.trace import TraceWindow, rank_trace, traced
from dpscale.log import get_logger
from dpscale.paths import write_no_follow

logger = get_logger(__name__)


class StepTrace:
    """This rank's traced steps, marked by the loop."""

    def __init__(self, window: TraceWindow, stats: Callable[[], StepStats | None]) -> None:
        self.telemetry = StepTelemetry(trace=window, trace_only=True)  # host clock: phases need it
        self._stats = stats

    def forward_begins(self, x: object, synced: bool) -> None:
        self.telemetry.on_forward((x,), {}, synced, self._comm, self._buckets)

    def forward_ends(self, synced: bool) -> None:
        if synced:
            self.telemetry.marks.synced_forward_end = time.perf_counter()

    def backward(self, start: float, end: float) -> None:
        marks = self.telemetry.marks
        marks.backward = (start, end)
        marks.backward_total_s += end - start

    def optimizer_done(self) -> None:
        marks = self.telemetry.marks
        marks.optimizer_end = time.perf_counter()
        marks.optimizer_steps += 1

    def _comm(self) -> tuple[float | None, float | None]:
        stats = self._stats()
        return (stats.exposed_comm_ms, stats.backward_ms) if stats is not None else (None, None)

    def _buckets(self) -> list[dict] | None:
        return bucket_spans(self._stats(), self.telemetry.marks.synced_forward_end)

    def write(self, directory: str, group: dist.ProcessGroup | None, transport: str) -> str:
        """rank<r>.trace.json in `directory`; collective (every rank's traced step times)."""
        telemetry = self.telemetry
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        doc = {"rank": rank, "world_size": world, "transport": transport, **telemetry.to_dict()}
        mine = {r["step"]: r["step_ms"] for r in traced(doc["records"])}
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine, group=group)
        idle = {k: max(d.get(k, t) for d in everyone) - t for k, t in mine.items()}
        if rank == 0 and not mine:
            logger.warning(
                "--trace: no step of %s ran to its end in this run, so the traces hold none", telemetry.trace
            )
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"rank{rank}.trace.json"
        write_no_follow(path, json.dumps(rank_trace(doc, idle, telemetry.trace)))
        return str(path)
