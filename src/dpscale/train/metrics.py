"""What rank 0 shows and records: per-step JSON lines, optional TensorBoard, progress, a summary.

Metrics are data: one `StepMetrics` per optimizer step, written as a JSON line, so reports and
other tools read the file instead of scraping logs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, TextIO

from dpscale.paths import open_no_follow, write_no_follow


@dataclass
class StepMetrics:
    step: int
    samples_seen: int
    loss: float
    lr: float
    grad_norm: float
    step_ms: float
    samples_per_s: float
    comm_ms: float | None
    exposed_comm_ms: float | None
    skipped: bool = False
    gns: float | None = None  # smoothed noise scale B_simple in samples (train/adaptive/noise_meter.py)


class MetricsWriter:
    """`metrics.jsonl` in `directory` (line-buffered, so a killed run keeps what it logged)."""

    def __init__(self, directory: str | None, resumed_from: int | None = None):
        """`resumed_from`: the step a resumed run continues from; the file keeps the lines up to it
        and goes on after them (a fresh run, None, starts the file over)."""
        self._file: IO[str] | None = None
        self._tb = None
        if directory is None:
            return
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        file = path / "metrics.jsonl"
        if resumed_from is not None:
            _keep_steps_up_to(file, resumed_from)
        self._file = open_no_follow(file, "a" if resumed_from is not None else "w", buffering=1)
        try:
            from torch.utils.tensorboard import SummaryWriter

            # the same for its events: those of the steps that run again are purged
            purge = None if resumed_from is None else resumed_from + 1
            self._tb = SummaryWriter(str(path / "tensorboard"), purge_step=purge)
        except ImportError:  # tensorboard is optional
            self._tb = None

    def write(self, m: StepMetrics) -> None:
        if self._file is not None:
            self._file.write(json.dumps(asdict(m)) + "\n")
        if self._tb is not None:
            keys = (
                "loss",
                "lr",
                "grad_norm",
                "step_ms",
                "samples_per_s",
                "comm_ms",
                "exposed_comm_ms",
                "gns",
            )
            for key in keys:
                value = getattr(m, key)
                if value is not None:
                    self._tb.add_scalar(f"train/{key}", value, m.step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def _keep_steps_up_to(path: Path, step: int) -> None:
    """Drop the lines of steps after `step`: a run that resumes from an earlier checkpoint (after
    a kill, a restart, a damaged newest checkpoint) logs those steps again, and one line per step
    is what a plot of the file needs. A line a kill cut short goes too."""
    if path.is_symlink() or not path.is_file():
        return  # a link is refused when the file is opened
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue
    tmp = path.with_name(path.name + ".tmp")
    write_no_follow(tmp, "".join(kept))
    os.replace(tmp, path)


class Progress:
    """A rich progress bar on a terminal; plain lines every `every` steps elsewhere (logs, CI)."""

    def __init__(self, total_steps: int, mode: str = "auto", every: int = 0, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.total = total_steps
        if mode == "auto":
            # the bar is rich's, which comes with the lab extra; without it, plain lines
            mode = "bar" if self.stream.isatty() and importlib.util.find_spec("rich") else "plain"
        self.mode = mode
        self.every = every or max(1, total_steps // 10)
        self._bar = None
        if mode == "bar":
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                transient=False,
            )
            self._task = self._bar.add_task("train", total=total_steps, info="")
            self._bar.start()

    def update(self, m: StepMetrics) -> None:
        info = f"loss {m.loss:.4f}  {m.samples_per_s:,.0f} samples/s"
        if self._bar is not None:
            self._bar.update(self._task, completed=m.step, info=info)
        elif self.mode == "plain" and (m.step % self.every == 0 or m.step == self.total):
            skipped = "  (skipped: non-finite gradient)" if m.skipped else ""
            print(f"step {m.step}/{self.total}  {info}  lr {m.lr:.3g}{skipped}", file=self.stream, flush=True)

    def note(self, text: str) -> None:
        """An event worth a line (a resume, a skipped step): shown in every mode, "none" included,
        which hides only the per-step progress."""
        if self._bar is not None:
            self._bar.console.print(text)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def summary_table(rows: list[tuple[str, str]], stream: TextIO | None = None) -> None:
    """Two-column summary at the end of a run."""
    stream = stream or sys.stderr
    width = max(len(k) for k, _ in rows)
    print("-" * (width + 24), file=stream)
    for k, v in rows:
        print(f"{k:<{width}}  {v}", file=stream)
    print("-" * (width + 24), file=stream, flush=True)
