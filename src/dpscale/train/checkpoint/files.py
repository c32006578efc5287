"""Checkpoints on disk: atomic writes and verified loads (the RNG states they hold: rank_state.py).

A checkpoint is a directory `step-XXXXXXXX` holding one `torch.save` file per payload entry and a
`manifest.json` (written last) with each file's size and SHA-256 and the id of the run that wrote
it: a directory may hold the checkpoints of another run (copied in, or left by an earlier job), and
pruning and loading then keep to one run's. Files on disk are untrusted: every
load is checked against the manifest and goes through `torch.load(weights_only=True)`, so a tampered
file is reported and skipped, never executed. There is a single writer (rank 0); no torch.distributed here.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import warnings
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dpscale.errors import ConfigError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
# a real manifest is a few hundred bytes; reading an attacker's multi-GB one would exhaust memory
MAX_MANIFEST_BYTES = 1 << 20

_STEP_DIR = re.compile(r"step-(\d{8,})")
_TMP_DIR = re.compile(r"\.tmp-step-(\d{8,})-.*")
_STEM = re.compile(r"[A-Za-z0-9_-]+")
# exactly the containers and leaves torch.load(weights_only=True) rebuilds without an allowlist;
# OrderedDict, torch.Size and Parameter are what state_dict() and optimizers actually produce
_CONTAINERS = (dict, OrderedDict, list, tuple, torch.Size)
_LEAVES = (int, float, str, bool, type(None))
RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
# the run of a checkpoint written before manifests named their run: all such belong to one run
UNNAMED_RUN = "unnamed"


class CheckpointError(ConfigError):
    """No usable checkpoint: the message names each rejected file and why."""


class CheckpointWarning(UserWarning):
    """A checkpoint was rejected and an older one will be tried."""


@dataclass
class LoadedCheckpoint:
    path: Path
    step: int
    payload: dict[str, Any]
    # one line per newer checkpoint that was rejected on the way to this one (empty if none)
    skipped: list[str]
    run_id: str = UNNAMED_RUN
    # what was verified: hand it to a later load (`trusted`) so the files are not hashed twice
    verified: dict[str, Any] | None = None


class _Rejected(Exception):
    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"checkpoint {path}: {reason}")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def save_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    payload: dict[str, Any],
    *,
    keep_last: int = 3,
    on_file: Callable[[int, str], None] | None = None,
    run_id: str = UNNAMED_RUN,
) -> Path:
    """Write `payload` (stem -> weights_only-safe object) as checkpoint `step` of run `run_id` under
    `root`; returns its path.

    Keeps `keep_last` checkpoints of this run: this one and the `keep_last - 1` others with the
    highest steps; another run's are never touched (an unreadable entry counts as this run's).
    Also removes `.tmp-*` directories left by a writer that was killed: a writer holds a lock on
    its temporary directory while it writes, so one still being written is never taken for a leftover.
    `on_file(step, stem)` is called after each file is written into the temporary directory
    (trainer callbacks: tests kill the writer there).
    """
    if keep_last < 1:
        raise ConfigError(f"keep_last must be >= 1 (got {keep_last}); it is how many checkpoints to keep")
    if type(step) is not int or step < 0:
        raise ConfigError(f"step must be a non-negative int (got {step!r})")
    if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
        raise ConfigError(f"run_id {run_id!r} must be 1 to 64 letters, digits, '_' or '-'")
    if not payload:
        raise ConfigError("payload is empty; pass at least one entry such as {'model': model.state_dict()}")
    for stem, obj in payload.items():
        if not isinstance(stem, str) or not _STEM.fullmatch(stem):
            raise ConfigError(f"payload key {stem!r} is not a file stem; use letters, digits, '_' or '-'")
        _check_weights_only_safe(obj, stem)

    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise type(e)(e.errno, f"cannot create checkpoint root {root}: {e.strerror}") from e
    for stale in root.glob(".tmp-*"):
        _remove_if_abandoned(stale)

    final = root / step_dir_name(step)
    with contextlib.ExitStack() as held:
        tmp = _locked_tmp_dir(root, step, held)  # released when the write is done, or by the writer's death
        _write(root, tmp, final, step, payload, on_file, run_id)
    older = sorted((s, p) for s, p in _step_entries(root) if p != final and _run_of(p) in (run_id, None))
    for old_step, path in older[: max(0, len(older) - (keep_last - 1))]:
        _discard(path, old_step)
    return final


def _write(
    root: Path,
    tmp: Path,
    final: Path,
    step: int,
    payload: dict[str, Any],
    on_file: Callable[[int, str], None] | None,
    run_id: str,
) -> None:
    aside = None
    try:
        files = []
        for stem, obj in payload.items():
            path = tmp / f"{stem}.pt"
            with open(path, "wb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
            files.append({"name": path.name, "size_bytes": path.stat().st_size, "sha256": _sha256(path)})
            if on_file is not None:
                on_file(step, stem)
        # the manifest goes last: a directory without one is by definition incomplete
        manifest = {"format_version": FORMAT_VERSION, "step": step, "run_id": run_id, "files": files}
        with open(tmp / MANIFEST_NAME, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)

        # a directory cannot be renamed onto a non-empty one, so an existing checkpoint of this step
        # is moved aside first. A crash between the two renames leaves both as .tmp-* (removed by the
        # next save); older checkpoints are untouched, so only this step is lost.
        # (whatever is there: a file or a link of that name is replaced like an old checkpoint)
        aside = _move_aside(final, step) if final.exists() or final.is_symlink() else None
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        if aside is not None and not final.exists():
            os.replace(aside, final)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if aside is not None:
        _remove(aside)


def load_latest(
    root: str | os.PathLike[str],
    *,
    expected_stems: Collection[str] = (),
    only: Collection[str] | None = None,
    run_id: str | None = None,
    trusted: dict[str, Any] | None = None,
) -> LoadedCheckpoint | None:
    """Load the newest checkpoint under `root` that verifies; None if there is none at all.

    With `run_id`, only that run's checkpoints count (another run's are neither loaded nor
    rejected). `trusted` is an earlier load's `verified`: its files, unchanged since (same inode,
    size and change time), are not hashed again.

    Each rejected newer checkpoint is warned about (CheckpointWarning) and listed in `skipped`.
    Raises CheckpointError if checkpoints exist but none verifies. A checkpoint lacking any of
    `expected_stems` (e.g. {"model", "optimizer"}) is rejected like a corrupt one. With `only`,
    every file is verified but only those stems are loaded (a look at the trainer's state
    without reading the model into memory).
    """
    root = Path(root)
    if not root.is_dir():
        return None
    skipped: list[str] = []
    for step, path in sorted(_step_entries(root), reverse=True):
        try:
            if path.is_symlink() or not path.is_dir():
                raise _Rejected(path, "is not a directory (a checkpoint is a directory dpscale writes)")
            if run_id is not None and _run_of(path) not in (run_id, None):
                continue  # another run's: not ours to load, nor to call damaged
            manifest_step, stems, verified = _verify(path, expected_stems, trusted)
            if manifest_step != step:
                raise _Rejected(path / MANIFEST_NAME, f"manifest says step {manifest_step}, not {step}")
            payload = _load(path, [s for s in stems if only is None or s in only])
        except _Rejected as e:
            skipped.append(str(e))
            warnings.warn(f"{e}; trying an older checkpoint", CheckpointWarning, stacklevel=2)
            continue
        _remove_tmp_dirs_before(root, step)
        return LoadedCheckpoint(
            path=path,
            step=step,
            payload=payload,
            skipped=skipped,
            run_id=_run_of(path) or UNNAMED_RUN,
            verified=verified,
        )
    if skipped:
        # one line (the CLI shows a ConfigError's first line only), newest first
        raise CheckpointError(f"no valid checkpoint under {root}: " + "; ".join(skipped))
    return None


def load_checkpoint(
    path: str | os.PathLike[str], *, expected_stems: Collection[str] = ()
) -> LoadedCheckpoint:
    """Verify and load the one checkpoint directory `path`; CheckpointError names the bad file and why."""
    path = Path(path)
    try:
        step, stems, verified = _verify(path, expected_stems)
        payload = _load(path, stems)
    except _Rejected as e:
        raise CheckpointError(str(e)) from None
    run_id = _run_of(path) or UNNAMED_RUN
    return LoadedCheckpoint(
        path=path, step=step, payload=payload, skipped=[], run_id=run_id, verified=verified
    )


def runs_in(root: str | os.PathLike[str]) -> dict[str, list[int]]:
    """The runs whose checkpoints are under `root`: run id -> its steps, ascending (entries whose
    manifest cannot be read are left out: they are no run's, and loading skips them)."""
    root = Path(root)
    if not root.is_dir():
        return {}
    runs: dict[str, list[int]] = {}
    for step, path in sorted(_step_entries(root)):
        if (run := _run_of(path)) is not None:
            runs.setdefault(run, []).append(step)
    return runs


def remove_checkpoints(root: str | os.PathLike[str]) -> int:
    """Delete every checkpoint under `root` (starting a run over); returns how many there were."""
    entries = _step_entries(Path(root)) if Path(root).is_dir() else []
    for step, path in entries:
        _discard(path, step)
    return len(entries)


def _run_of(directory: Path) -> str | None:
    """The run that wrote checkpoint `directory` (UNNAMED_RUN before manifests named it); None
    when its manifest cannot be read (not a checkpoint, or a damaged one)."""
    manifest_path = directory / MANIFEST_NAME
    try:
        if manifest_path.is_symlink() or manifest_path.stat().st_size > MAX_MANIFEST_BYTES:
            return None
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    run = manifest.get("run_id", UNNAMED_RUN) if isinstance(manifest, dict) else None
    return run if isinstance(run, str) and RUN_ID.fullmatch(run) else None


def _verify(
    directory: Path, expected_stems: Collection[str], trusted: dict[str, Any] | None = None
) -> tuple[int, list[str], dict[str, Any]]:
    """Check `directory` against its manifest; returns the step, the file stems it lists and what
    was verified (for `trusted`: each file's identity once its hash matched)."""
    known = trusted.get("files", {}) if trusted and trusted.get("path") == str(directory) else {}
    verified: dict[str, Any] = {"path": str(directory), "files": {}}
    manifest_path = directory / MANIFEST_NAME
    if not manifest_path.is_file():
        raise _Rejected(manifest_path, "missing (partial checkpoint: the writer did not finish)")
    if manifest_path.is_symlink() or manifest_path.stat().st_size > MAX_MANIFEST_BYTES:
        raise _Rejected(manifest_path, "is a symbolic link or larger than a manifest can be")
    try:
        manifest = json.loads(_read_text(manifest_path))
        if manifest["format_version"] != FORMAT_VERSION:
            raise _Rejected(
                manifest_path, f"format_version {manifest['format_version']} is not {FORMAT_VERSION}"
            )
        step = manifest["step"]
        entries = [(e["name"], e["size_bytes"], e["sha256"]) for e in manifest["files"]]
    except RecursionError:  # nesting deeper than the parser's stack: no manifest looks like that
        raise _Rejected(manifest_path, "unparseable (nested too deeply)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise _Rejected(manifest_path, f"unparseable ({type(e).__name__}: {e})") from None
    if type(step) is not int or not entries:
        raise _Rejected(manifest_path, "unparseable (step is not an int, or no files are listed)")
    stems = []
    for name, size_bytes, sha256 in entries:
        # names come from an untrusted file: no path separators, so nothing outside `directory` is read
        if not isinstance(name, str) or not name.endswith(".pt") or not _STEM.fullmatch(name[:-3]):
            raise _Rejected(manifest_path, f"lists an invalid file name {name!r}")
        verified["files"][name] = _verify_file(directory / name, size_bytes, sha256, known.get(name))
        stems.append(name[:-3])
    missing = sorted(set(expected_stems) - set(stems))
    if missing:
        raise _Rejected(manifest_path, f"lists no file for {missing}")
    return step, stems, verified


def _verify_file(path: Path, size_bytes: object, sha256: object, known: object) -> list:
    """Check one listed file; returns its identity (device, inode, size, times, hash), with which
    a later load whose `trusted` holds it skips the hash."""
    if not path.is_file():
        raise _Rejected(path, "missing")
    if path.is_symlink():
        # the writer never makes links; one could point at any file this user can read
        raise _Rejected(path, "is a symbolic link; a checkpoint holds regular files only")
    st = path.stat()
    if st.st_size != size_bytes:
        raise _Rejected(path, f"size {st.st_size} bytes, manifest says {size_bytes} (truncated or changed)")
    # any write to a file changes its ctime, which no user call can set back
    identity = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, sha256]
    if known != identity:
        try:
            digest = _sha256(path)
        except OSError as e:
            raise _Rejected(path, f"unreadable ({type(e).__name__}: {e.strerror})") from None
        if digest != sha256:
            raise _Rejected(path, "sha256 mismatch (file changed or corrupt)")
    return identity


def _load(directory: Path, stems: list[str]) -> dict[str, Any]:
    payload = {}
    for stem in stems:
        path = directory / f"{stem}.pt"
        try:
            payload[stem] = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # untrusted bytes can fail in many ways; every one means "reject"
            raise _Rejected(path, f"refused by torch.load(weights_only=True): {_one_line(e)}") from None
    return payload


def _check_weights_only_safe(obj: Any, where: str) -> None:
    # checked at save time: a checkpoint that weights_only loading refuses would only fail at resume
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            raise ConfigError(f"payload[{where}] is a {type(obj).__name__}; save a plain tensor instead")
    elif type(obj) in _CONTAINERS:
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for key, value in items:
            if isinstance(obj, dict):
                _check_weights_only_safe(key, f"{where} key {key!r}")
            _check_weights_only_safe(value, f"{where}[{key!r}]")
    elif type(obj) not in _LEAVES:
        raise ConfigError(
            f"payload[{where}] is a {type(obj).__name__}, which torch.load(weights_only=True) refuses; "
            "convert it to tensors, dicts, lists, tuples, int, float, str, bool or None"
        )


def _step_entries(root: Path) -> list[tuple[int, Path]]:
    """Every `step-N` entry, directory or not: the loader says why it skips one that is not."""
    return [(int(m[1]), p) for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name))]


def _move_aside(path: Path, step: int) -> Path:
    # renaming before deleting means a crash mid-delete leaves a .tmp-* (cleaned later), never a
    # half-deleted step-* directory that a loader would have to reject
    aside = path.parent / f".tmp-step-{step:08d}-discard-{secrets.token_hex(8)}"
    os.replace(path, aside)
    return aside


def _discard(path: Path, step: int) -> None:
    _remove(_move_aside(path, step))


def _remove(path: Path) -> None:
    """Delete a directory tree, or a file or link (what a user may have put under a step-N name)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _locked_tmp_dir(root: Path, step: int, held: contextlib.ExitStack) -> Path:
    """A fresh `.tmp-*` directory under an exclusive lock that `held` releases."""
    while True:
        tmp = root / f".tmp-step-{step:08d}-{secrets.token_hex(8)}"
        tmp.mkdir()
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_nlink > 0:
            held.callback(os.close, fd)
            return tmp
        # a cleaner took it for a leftover between mkdir and flock, and removed it: take another
        os.close(fd)


def _remove_if_abandoned(path: Path) -> None:
    """Remove a `.tmp-*` entry unless a live writer holds its lock (best effort: races are fine)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except NotADirectoryError:
        path.unlink(missing_ok=True)
        return
    except OSError:
        return  # gone already, or not ours to read
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return  # its writer is alive: this is a write in progress, not a leftover
    try:
        shutil.rmtree(path, ignore_errors=True)  # under the lock: no writer takes it meanwhile
    finally:
        os.close(fd)


def _remove_tmp_dirs_before(root: Path, step: int) -> None:
    # Only tmp directories older than the checkpoint just loaded and abandoned by their writer: a
    # reader (an evaluator, say) may run while the trainer writes a newer step, and must not delete
    # that write. Newer leftovers are removed by the next save. Best effort, so a reader on a
    # read-only mount can still load.
    for path in root.glob(".tmp-*"):
        m = _TMP_DIR.fullmatch(path.name)
        if m and int(m[1]) < step:
            _remove_if_abandoned(path)


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise _Rejected(path, f"unreadable ({type(e).__name__}: {e.strerror})") from None


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fsync_dir(path: Path) -> None:
    # a rename or a new file is durable only once its directory entry is flushed
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _one_line(exc: Exception) -> str:
    text = str(exc)
    # torch's weights_only message is a page of advice; the reason is after this marker
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1].strip().split("\n\n", 1)[0]
    text = re.sub(r"\x1b\[[0-9;]*m", "", " ".join(text.split()))
    return f"{type(exc).__name__}: {text[:200]}"
