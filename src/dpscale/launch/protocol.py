"""What passes between `dpscale train`'s launcher and its workers: environment names and records.

The launcher writes a `LaunchSpec` (the config, the threads, where the other records go) into a
temporary directory and names it in `LAUNCH_SPEC_ENV`; each worker reads it. Rank 0 (on each
host, its first worker) writes the run's result next to it. A worker whose collective timed out
writes a `WorkerFailure` naming the ranks that did not answer (the ones that hung), so the
launcher's failure summary is rendered from data rather than parsed from an error's text. A worker
refused by its input (a checkpoint that does not fit, the user's task failing) writes one too, with
the one-line reason, and exits 0 so that the agent does not restart it to be refused again: the
launcher prints the reason and exits 2.
Both sides import this file; neither imports the other.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

# the JSON file holding the LaunchSpec
LAUNCH_SPEC_ENV = "DPSCALE_LAUNCH_SPEC"
# the launcher's pid: a worker dies with it (process_life.die_with_parent)
LAUNCHER_PID_ENV = "DPSCALE_LAUNCHER_PID"


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """A worker's task, from the launcher."""

    config: dict
    """TrainConfig.to_dict()"""
    threads: int
    """intra-op threads per worker"""
    result: str
    """where rank 0 writes its result (TrainResult.to_dict())"""
    stop: str
    """the file whose appearance asks the workers to stop after a step; it holds the signal's name"""
    failures: str
    """the directory where a worker writes its WorkerFailure"""
    trusted_checkpoint: dict | None = None
    """the checkpoint the launcher verified for a resume (files.load_latest's `verified`): rank 0
    does not hash its unchanged files again"""

    @classmethod
    def in_dir(
        cls, directory: str | Path, *, config: dict, threads: int, trusted_checkpoint: dict | None = None
    ) -> LaunchSpec:
        """A spec whose records all live in `directory` (the launcher's temporary directory)."""
        d = Path(directory)
        return cls(
            config=config,
            threads=threads,
            result=str(d / "result.json"),
            stop=str(d / "stop"),
            failures=str(d),
            trusted_checkpoint=trusted_checkpoint,
        )

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self)))

    @classmethod
    def read(cls, path: str | Path) -> LaunchSpec:
        return cls(**json.loads(Path(path).read_text()))


def write_atomically(path: str | Path, record: dict) -> None:
    """Write `record` as JSON so that a reader never sees half of it."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def read_record(path: str | Path) -> dict | None:
    """The JSON object at `path`, or None when it is missing or unreadable."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


@dataclass(frozen=True, kw_only=True)
class WorkerFailure:
    """`failure.json`: a worker's collective failed, and these ranks did not answer in time."""

    rank: int
    """the global rank that wrote it"""
    pid: int
    """its process id: tells this attempt's record from an earlier attempt's"""
    silent_ranks: list[int]
    """the ranks that did not report (dead or hung): the ones to look at"""
    bad_input: str = ""
    """the worker's input was refused (a ConfigError): its one-line message"""
    user_traceback: str = ""
    """with bad_input from the user's own code: the frames of their files (errors.UserCodeError)"""

    def write(self, directory: str | Path) -> None:
        write_atomically(failure_path(directory, self.rank), asdict(self))

    @classmethod
    def read(cls, directory: str | Path, rank: int, pid: int) -> WorkerFailure | None:
        """Rank `rank`'s record if its process `pid` wrote one, else None."""
        record = read_record(failure_path(directory, rank))
        try:
            failure = cls(**record) if record is not None else None
        except TypeError:
            return None
        if failure is None or failure.pid != pid or failure.rank != rank:
            return None
        return failure


def refusals(directory: str | Path) -> list[WorkerFailure]:
    """Every record in `directory` of a worker refused by its input, lowest rank first."""
    found = []
    for path in sorted(Path(directory).glob("failure-rank*.json")):
        record = read_record(path)
        try:
            failure = WorkerFailure(**record) if record is not None else None
        except TypeError:
            continue
        if failure is not None and failure.bad_input:
            found.append(failure)
    return sorted(found, key=lambda f: f.rank)


def failure_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"failure-rank{rank}.json"
