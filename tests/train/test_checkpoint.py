"""Checkpoints: round trips, pruning, corruption and tampering are rejected, RNG state resumes exactly."""

import hashlib
import json
import os
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dpscale.train.checkpoint.files import (
    CheckpointError,
    CheckpointWarning,
    load_checkpoint,
    load_latest,
    save_checkpoint,
)
from dpscale.train.checkpoint.rank_state import capture_rng_state, restore_rng_state


def _assert_same(a, b, where="payload"):
    # exact equality: a checkpoint is a byte copy, so no tolerance is justified
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _train_step(model: nn.Module, *optimizers: torch.optim.Optimizer) -> None:
    x = torch.arange(12.0).reshape(3, 4) / 10
    for opt in optimizers:
        opt.zero_grad()
    model(x).square().sum().backward()
    for opt in optimizers:
        opt.step()


def _make_optimizers(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    # SGD on the first layer and Adam on the second, so each optimizer has state worth saving
    sgd = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
    adam = torch.optim.Adam(model[2].parameters(), lr=0.01)
    return sgd, adam


def _save_simple(root: Path, step: int, **kw) -> Path:
    return save_checkpoint(
        root, step, {"model": {"w": torch.full((16,), float(step))}, "trainer": {"step": step}}, **kw
    )


def _dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _rewrite_manifest_entry(directory: Path, name: str) -> None:
    manifest_path = directory / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    data = (directory / name).read_bytes()
    for entry in manifest["files"]:
        if entry["name"] == name:
            entry["size_bytes"] = len(data)
            entry["sha256"] = hashlib.sha256(data).hexdigest()
    manifest_path.write_text(json.dumps(manifest))


def test_round_trip_of_model_and_optimizers_resumes_identically(tmp_path):
    model = _model()
    sgd, adam = _make_optimizers(model)
    _train_step(model, sgd, adam)
    payload = {
        "model": model.state_dict(),
        "sgd": sgd.state_dict(),
        "adam": adam.state_dict(),
        "trainer": {"epoch": 3, "samples_seen": 1234, "best_loss": 0.5, "tag": "run-a", "done": False},
    }
    path = save_checkpoint(tmp_path, 10, payload)
    assert path == tmp_path / "step-00000010"

    loaded = load_latest(tmp_path)
    assert loaded is not None
    assert (loaded.path, loaded.step, loaded.skipped) == (path, 10, [])
    _assert_same(payload, loaded.payload)

    # the test of record: resuming from the checkpoint continues exactly as if never interrupted
    resumed = _model()
    resumed_sgd, resumed_adam = _make_optimizers(resumed)
    resumed.load_state_dict(loaded.payload["model"])
    resumed_sgd.load_state_dict(loaded.payload["sgd"])
    resumed_adam.load_state_dict(loaded.payload["adam"])
    _train_step(model, sgd, adam)
    _train_step(resumed, resumed_sgd, resumed_adam)
    _assert_same(model.state_dict(), resumed.state_dict())


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path):
    path = _save_simple(tmp_path, 7)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 7 and manifest["format_version"] == 1
    assert sorted(e["name"] for e in manifest["files"]) == ["model.pt", "trainer.pt"]
    for entry in manifest["files"]:
        data = (path / entry["name"]).read_bytes()
        assert entry["size_bytes"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert _dirs(tmp_path) == ["step-00000007"]


def test_keep_last_prunes_older_checkpoints(tmp_path):
    for step in range(1, 6):
        _save_simple(tmp_path, step, keep_last=2)
    assert _dirs(tmp_path) == ["step-00000004", "step-00000005"]


def test_resaving_the_same_step_replaces_it(tmp_path):
    _save_simple(tmp_path, 3)
    save_checkpoint(tmp_path, 3, {"trainer": {"version": 2}})
    assert _dirs(tmp_path) == ["step-00000003"]
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.payload == {"trainer": {"version": 2}}


def test_failed_resave_keeps_the_old_checkpoint_and_leaves_no_tmp(tmp_path, monkeypatch):
    _save_simple(tmp_path, 3)
    real_replace = os.replace

    def failing_replace(src, dst):
        # fail only the final rename of the new checkpoint, after the old one was moved aside
        if Path(src).name.startswith(".tmp-") and "discard" not in Path(src).name:
            raise OSError("disk full")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 3, {"trainer": {"version": 2}})
    assert _dirs(tmp_path) == ["step-00000003"]
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.payload["trainer"] == {"step": 3}


def _flip_byte(ckpt: Path) -> Path:
    path = ckpt / "model.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def _truncate(ckpt: Path) -> Path:
    path = ckpt / "model.pt"
    path.write_bytes(path.read_bytes()[:100])
    return path


def _delete_manifest(ckpt: Path) -> Path:
    path = ckpt / "manifest.json"
    path.unlink()
    return path


def _garble_manifest(ckpt: Path) -> Path:
    path = ckpt / "manifest.json"
    path.write_text('{"format_version": 1, "step": ')
    return path


def _delete_file(ckpt: Path) -> Path:
    path = ckpt / "trainer.pt"
    path.unlink()
    return path


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_flip_byte, "sha256 mismatch"),
        (_truncate, "truncated"),
        (_delete_manifest, "partial checkpoint"),
        (_garble_manifest, "unparseable"),
        (_delete_file, "missing"),
    ],
)
def test_damaged_newest_checkpoint_falls_back_to_previous(tmp_path, damage, reason):
    _save_simple(tmp_path, 10)
    bad_file = damage(_save_simple(tmp_path, 20))
    with pytest.warns(CheckpointWarning, match=str(bad_file)) as record:
        loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.step == 10
    assert loaded.payload["model"]["w"][0].item() == 10.0
    assert len(loaded.skipped) == 1 and str(bad_file) in loaded.skipped[0] and reason in loaded.skipped[0]
    assert len(record) == 1 and "\n" not in str(record[0].message)


def test_checkpoint_missing_an_expected_stem_is_skipped(tmp_path):
    _save_simple(tmp_path, 10)
    save_checkpoint(tmp_path, 20, {"model": {"w": torch.zeros(2)}})
    with pytest.warns(CheckpointWarning, match="trainer"):
        loaded = load_latest(tmp_path, expected_stems={"model", "trainer"})
    assert loaded is not None and loaded.step == 10


def _symlink_file(directory: Path) -> Path:
    # a valid file, moved out and linked back: only the link itself gives it away
    path = directory / "model.pt"
    target = directory.parent / "elsewhere.pt"
    path.rename(target)
    path.symlink_to(target)
    return path


def _huge_manifest(directory: Path) -> Path:
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["padding"] = "x" * (2 << 20)
    path.write_text(json.dumps(manifest))
    return path


@pytest.mark.parametrize(
    "damage,reason", [(_symlink_file, "symbolic link"), (_huge_manifest, "larger than a manifest can be")]
)
def test_links_and_oversized_manifests_are_refused(tmp_path, damage, reason):
    _save_simple(tmp_path, 10)
    bad = damage(_save_simple(tmp_path, 20))
    with pytest.warns(CheckpointWarning, match=reason):
        loaded = load_latest(tmp_path)
    assert loaded.step == 10 and str(bad) in loaded.skipped[0]


def test_tmp_dir_of_a_killed_writer_is_never_loaded_and_is_removed(tmp_path):
    _save_simple(tmp_path, 10)
    newest = _save_simple(tmp_path, 20)
    # complete-looking copies, as if the writer died just before the final rename
    older_tmp = tmp_path / ".tmp-step-00000015-0123abcd"
    newer_tmp = tmp_path / ".tmp-step-00000030-4567cdef"
    for tmp in (older_tmp, newer_tmp):
        shutil.copytree(newest, tmp)

    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.path == newest and loaded.skipped == []
    # loading removes leftovers older than what it loaded; a newer one may be a write in progress
    assert not older_tmp.exists() and newer_tmp.exists()

    _save_simple(tmp_path, 30)
    assert _dirs(tmp_path) == ["step-00000010", "step-00000020", "step-00000030"]


def test_only_tmp_dirs_is_no_checkpoint(tmp_path):
    (tmp_path / ".tmp-step-00000005-00ff").mkdir()
    assert load_latest(tmp_path) is None


class _OpensFile:
    """Unpickling this calls open(sentinel, "w"): the file exists iff the pickle ran code."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return (open, (str(self.sentinel), "w"))


# torch warns about the pickle protocol of the raw pickle before refusing it; that is expected here
@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
@pytest.mark.parametrize("fmt", ["torch.save", "raw pickle"])
def test_malicious_pickle_with_matching_manifest_is_rejected_not_run(tmp_path, fmt):
    sentinel = tmp_path / "pwned"
    root = tmp_path / "ckpts"
    _save_simple(root, 10)
    bad = _save_simple(root, 20)
    evil = bad / "model.pt"
    if fmt == "torch.save":
        torch.save(_OpensFile(sentinel), evil)
    else:
        # protocol 2 so the refusal is about the global it names, not an unsupported opcode
        evil.write_bytes(pickle.dumps(_OpensFile(sentinel), protocol=2))
    _rewrite_manifest_entry(bad, "model.pt")  # the attacker also controls the manifest

    with pytest.warns(CheckpointWarning, match="weights_only") as record:
        loaded = load_latest(root)
    assert loaded is not None and loaded.step == 10
    assert str(evil) in str(record[0].message)
    with pytest.raises(CheckpointError, match="weights_only"):
        load_checkpoint(bad)
    assert not sentinel.exists()

    # control: the same bytes do run code when loaded without weights_only, so the test is not vacuous
    handle = pickle.loads(evil.read_bytes()) if fmt == "raw pickle" else torch.load(evil, weights_only=False)
    handle.close()
    assert sentinel.exists()


def test_all_checkpoints_bad_raises_with_every_reason(tmp_path):
    first = _flip_byte(_save_simple(tmp_path, 1))
    second = _delete_manifest(_save_simple(tmp_path, 2))
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError) as info:
        load_latest(tmp_path)
    assert str(first) in str(info.value) and str(second) in str(info.value)


def test_load_checkpoint_names_file_and_reason(tmp_path):
    bad_file = _truncate(_save_simple(tmp_path, 4))
    with pytest.raises(CheckpointError, match=f"{bad_file}: size"):
        load_checkpoint(tmp_path / "step-00000004")


def test_empty_or_missing_root_is_no_checkpoint(tmp_path):
    assert load_latest(tmp_path) is None
    assert load_latest(tmp_path / "missing") is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"keep_last": 0}, "keep_last"),
        ({"step": -1}, "step"),
        ({"payload": {"../model": {}}}, "file stem"),
        ({"payload": {"trainer": {"lr": np.float64(0.1)}}}, r"payload\[trainer\['lr'\]\] is a float64"),
        ({"payload": {}}, "payload is empty"),
    ],
)
def test_invalid_arguments_raise_value_error_and_write_nothing(tmp_path, kwargs, match):
    args = {"step": 1, "payload": {"model": {"w": torch.zeros(1)}}} | kwargs
    with pytest.raises(ValueError, match=match):
        save_checkpoint(tmp_path / "root", **args)
    assert not (tmp_path / "root").exists()


def test_unwritable_root_raises_os_error_naming_it(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match=str(blocker / "ckpts")):
        _save_simple(blocker / "ckpts", 1)


def _draw() -> tuple[torch.Tensor, np.ndarray, list[float]]:
    return torch.rand(5), np.random.randn(5), [random.random(), random.gauss(0.0, 1.0)]


def _prime_gaussian_caches() -> None:
    # both numpy and `random` cache the second of each Gaussian pair; restore must bring that back too
    np.random.seed(1)
    np.random.randn(1)
    random.seed(1)
    random.gauss(0.0, 1.0)
    torch.manual_seed(1)


def test_rng_state_restores_all_generators_exactly():
    _prime_gaussian_caches()
    state = capture_rng_state()
    first = _draw()
    restore_rng_state(state)
    second = _draw()
    assert torch.equal(first[0], second[0])
    assert np.array_equal(first[1], second[1])
    assert first[2] == second[2]


def test_rng_state_survives_a_weights_only_checkpoint(tmp_path):
    _prime_gaussian_caches()
    path = save_checkpoint(tmp_path, 1, {"rng": capture_rng_state()})
    first = _draw()
    _draw()  # move every generator on, as more training would
    restore_rng_state(load_checkpoint(path).payload["rng"])
    second = _draw()
    assert torch.equal(first[0], second[0])
    assert np.array_equal(first[1], second[1])
    assert first[2] == second[2]
    assert os.listdir(tmp_path) == ["step-00000001"]


class _FakeCuda:
    """torch.cuda's generator functions on a host with `count` GPUs, this worker on `current`."""

    def __init__(self, monkeypatch, count: int, current: int):
        self.states = {i: torch.tensor([i], dtype=torch.uint8) for i in range(count)}
        self.current = current
        for name in ("is_initialized", "is_available"):
            monkeypatch.setattr(torch.cuda, name, lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: self.states[self.current].clone())
        monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s: self.states.__setitem__(self.current, s))
        for name in ("get_rng_state_all", "set_rng_state_all"):  # the other workers' GPUs are theirs
            monkeypatch.setattr(torch.cuda, name, lambda *a, n=name: pytest.fail(f"{n} called"))


def test_rng_state_holds_only_this_workers_gpu_and_resumes_with_another_gpu_count(monkeypatch):
    cuda = _FakeCuda(monkeypatch, count=8, current=5)
    cuda.states[5] = torch.tensor([42], dtype=torch.uint8)
    state = capture_rng_state()
    assert torch.equal(state["cuda"], torch.tensor([42], dtype=torch.uint8))
    # resumed where this worker sees a single GPU (SLURM's --gpus-per-task=1)
    cuda = _FakeCuda(monkeypatch, count=1, current=0)
    restore_rng_state(state)
    assert torch.equal(cuda.states[0], torch.tensor([42], dtype=torch.uint8))


def test_an_older_checkpoints_every_gpu_generators_give_this_workers_own(monkeypatch):
    cuda = _FakeCuda(monkeypatch, count=2, current=1)
    state = capture_rng_state()
    state["cuda"] = [torch.tensor([7], dtype=torch.uint8), torch.tensor([9], dtype=torch.uint8)]
    restore_rng_state(state)
    assert torch.equal(cuda.states[1], torch.tensor([9], dtype=torch.uint8))


# -- issue #14 item 9: every kind of bad entry is skipped with its reason, and saving goes on -------


def _deep_manifest(directory: Path) -> Path:
    # under the size limit, but deeper than json's parser can recurse (RecursionError before)
    path = directory / "manifest.json"
    path.write_text("[" * 400_000 + "]" * 400_000)
    return path


def test_a_deeply_nested_manifest_is_skipped_not_raised(tmp_path):
    _save_simple(tmp_path, 10)
    bad = _deep_manifest(_save_simple(tmp_path, 20))
    with pytest.warns(CheckpointWarning, match="nested too deeply"):
        loaded = load_latest(tmp_path)
    assert loaded.step == 10 and str(bad) in loaded.skipped[0]


@pytest.mark.parametrize("which", ["manifest.json", "model.pt"])
def test_an_unreadable_file_is_skipped_with_its_reason(tmp_path, monkeypatch, which):
    """Tests run as root, which reads any file whatever its mode: the refusal is simulated at open()."""
    _save_simple(tmp_path, 10)
    bad = _save_simple(tmp_path, 20) / which
    real_open = open

    def guarded_open(file, *args, **kwargs):
        if Path(file) == bad:
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", guarded_open)
    monkeypatch.setattr("io.open", guarded_open)
    with pytest.warns(CheckpointWarning, match="unreadable"):
        loaded = load_latest(tmp_path)
    assert loaded.step == 10 and str(bad) in loaded.skipped[0] and "Permission denied" in loaded.skipped[0]


def test_a_plain_file_named_like_a_checkpoint_is_skipped_then_replaced_and_pruned(tmp_path):
    _save_simple(tmp_path, 10)
    (tmp_path / "step-00000005").write_text("an older plain file")
    (tmp_path / "step-00000020").write_text("not a checkpoint")
    with pytest.warns(CheckpointWarning, match="is not a directory"):
        loaded = load_latest(tmp_path)
    assert loaded.step == 10 and "step-00000020: is not a directory" in loaded.skipped[0]
    # the final save of that step replaces the file (it crashed with NotADirectoryError before)
    _save_simple(tmp_path, 20, keep_last=2)
    assert _dirs(tmp_path) == ["step-00000010", "step-00000020"]  # the older file was pruned
    assert load_latest(tmp_path).step == 20


def test_only_a_tmp_dir_whose_writer_is_gone_is_removed(tmp_path):
    """Issue #14 item 4: a second writer removed the first's temporary directory as "stale"."""
    import fcntl

    live = tmp_path / ".tmp-step-00000015-0123abcd"
    dead = tmp_path / ".tmp-step-00000016-4567cdef"
    live.mkdir()
    dead.mkdir()
    fd = os.open(live, os.O_RDONLY)  # what a writer in progress holds
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        _save_simple(tmp_path, 20)
        assert live.exists() and not dead.exists()
    finally:
        os.close(fd)
    _save_simple(tmp_path, 30)
    assert _dirs(tmp_path) == ["step-00000020", "step-00000030"]
