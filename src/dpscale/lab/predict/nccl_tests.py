"""Read nccl-tests' `all_reduce_perf` output: the all-reduce times a user measured on their own fabric.

The format (NVIDIA/nccl-tests, `src/common.cu`): header lines start with '#'; `# nThread T nGpus G
...` gives the threads and GPUs of each process; `#  Rank  R Group  G Pid  P on  HOST device ...`
(older versions without `Group`) names each rank and its host; then one row per message size:

    size count type redop root  time algbw busbw #wrong  time algbw busbw #wrong
                                 (out-of-place)           (in-place)

(`root` is absent in some versions, and `#wrong` is an error figure or N/A in others), and the
`# Avg bus bandwidth` footer. The world size is the number of rank lines (else nThread x nGpus, one
process); the nodes are the distinct hosts of the rank lines (else 1). Lines that are neither
header nor row (NCCL INFO, a version line, a shell prompt) are skipped; a row that does not parse
is refused, naming the file and line, before anything else is done with the file.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from dpscale.errors import ConfigError

FLAG = "--calibrate-from"
# an all_reduce_perf run from 8 B to 16 GB is ~40 rows and a few hundred rank lines: a file far
# larger is something else, and reading it whole would not be one quick call
MAX_FILE_BYTES = 4 << 20
MAX_ROWS = 1000

_RANK = re.compile(r"^#\s*Rank\s+(\d+)\s+(?:Group\s+\d+\s+)?Pid\s+\d+\s+on\s+(\S+)\s+device\b")
_THREADS = re.compile(r"^#\s*nThread\s+(\d+)\s+nGpus\s+(\d+)\b")


@dataclass(frozen=True)
class NcclTable:
    """One `all_reduce_perf` run: times per message size at one world size."""

    path: str
    world_size: int
    nodes: int  # distinct hosts of the rank lines (1 when the output names none)
    sizes_bytes: tuple[int, ...]  # ascending
    time_us: tuple[float, ...]  # out-of-place
    in_place_time_us: tuple[float, ...]
    busbw_GBps: tuple[float, ...]  # out-of-place, as nccl-tests printed it

    @property
    def per_node(self) -> int:
        return self.world_size // self.nodes


def _number(text: str, where: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{where}: {what} {text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{where}: {what} {text!r} is not a finite number >= 0")
    return value


def _row(fields: list[str], where: str) -> tuple[int, float, float, float]:
    """(size, out-of-place time, in-place time, out-of-place busbw) of one table row."""
    # size count type redop [root] time algbw busbw wrong time algbw busbw wrong
    if len(fields) not in (12, 13):
        raise ConfigError(
            f"{where}: a table row has 12 or 13 columns (size count type redop [root] time algbw busbw "
            f"#wrong, twice), this one {len(fields)}; give all_reduce_perf's output unchanged"
        )
    size = int(fields[0])
    if size < 1:
        raise ConfigError(f"{where}: size {size} bytes; a row's size is >= 1")
    out = fields[len(fields) - 8 :]
    t_out = _number(out[0], where, "out-of-place time")
    busbw = _number(out[2], where, "out-of-place busbw")
    t_in = _number(out[4], where, "in-place time")
    if not (t_out > 0 and t_in > 0):
        raise ConfigError(f"{where}: a time of 0 us; all_reduce_perf prints times > 0")
    return size, t_out, t_in, busbw


def _read_text(path: Path) -> str:
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ConfigError(
                f"{FLAG}: {path} is {size:,} bytes; all_reduce_perf output is far smaller "
                f"(at most {MAX_FILE_BYTES:,} read): give the output of one run"
            )
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)  # a file that grew since stat() is still bounded
    except OSError as e:
        raise ConfigError(f"{FLAG}: cannot read {path} ({e.strerror})") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{FLAG}: {path} is over {MAX_FILE_BYTES:,} bytes; give the output of one run")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(f"{FLAG}: {path} line {line}: not UTF-8 text") from None


def read_table(path: str | Path) -> NcclTable:
    """The table of an `all_reduce_perf` output file; ConfigError naming the file and line."""
    path = Path(path)
    text = _read_text(path)
    ranks: dict[int, str] = {}
    threads_gpus: int | None = None
    rows: list[tuple[int, float, float, float]] = []
    for k, line in enumerate(text.splitlines(), start=1):
        where = f"{FLAG}: {path} line {k}"
        stripped = line.strip()
        if stripped.startswith("#"):
            if m := _RANK.match(stripped):
                ranks[int(m.group(1))] = m.group(2)
            elif m := _THREADS.match(stripped):
                threads_gpus = int(m.group(1)) * int(m.group(2))
            continue
        fields = stripped.split()
        if not fields or not fields[0].isdigit():
            continue  # NCCL INFO lines, a version banner, a prompt: not the table
        if len(rows) >= MAX_ROWS:
            raise ConfigError(f"{where}: more than {MAX_ROWS} rows; give the output of one run")
        row = _row(fields, where)
        if rows and row[0] <= rows[-1][0]:
            raise ConfigError(
                f"{where}: size {row[0]} after {rows[-1][0]}; sizes must increase (one run per file)"
            )
        rows.append(row)
    if not rows:
        raise ConfigError(f"{FLAG}: {path} has no all_reduce_perf table rows (size count type redop ...)")
    world = len(ranks) or threads_gpus
    if world is None:
        raise ConfigError(
            f"{FLAG}: {path} has neither '# Rank N ...' lines nor '# nThread T nGpus G': cannot tell "
            "how many GPUs ran; give the whole output, header included"
        )
    if world < 2:
        raise ConfigError(f"{FLAG}: {path} ran on {world} GPU; an all-reduce calibration needs >= 2")
    hosts = set(ranks.values())
    nodes = len(hosts) or 1
    if world % nodes:
        raise ConfigError(f"{FLAG}: {path}: {world} ranks do not fill {nodes} hosts evenly")
    return NcclTable(
        path=str(path),
        world_size=world,
        nodes=nodes,
        sizes_bytes=tuple(r[0] for r in rows),
        time_us=tuple(r[1] for r in rows),
        in_place_time_us=tuple(r[2] for r in rows),
        busbw_GBps=tuple(r[3] for r in rows),
    )


def busbw_GBps(nbytes: float, time_us: float, world_size: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce (doc/PERFORMANCE.md): algbw x 2(n-1)/n."""
    return nbytes / (time_us * 1e3) * 2 * (world_size - 1) / world_size
