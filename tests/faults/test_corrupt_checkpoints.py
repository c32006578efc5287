"""Scenarios 3 and 4: checkpoints are untrusted input.

A damaged or tampered newest checkpoint is reported by file name and skipped; `dpscale train
--resume` continues from the previous one and, resuming at the same world size, ends with the
reference run's exact parameters. A pickle that would run code is refused by weights_only loading
even when the attacker also rewrote the manifest so that the checksum matches.
"""

import hashlib
import json
import os
import pickle
import shutil

import pytest

from support.cli_runs import TRAIN, last_json, run_cli

pytestmark = pytest.mark.slow  # starts processes (spawned ranks or the CLI)


def _copy_checkpoints(reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference["checkpoint_dir"], ckpt)
    return ckpt


def _resume(ckpt):
    return run_cli(TRAIN + ["--checkpoint-dir", str(ckpt), "--resume"])


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)


@pytest.mark.parametrize(
    "damage,reason",
    [(_flip_byte, "sha256 mismatch"), (_truncate, "truncated or changed")],
    ids=["flip", "cut"],
)
def test_damaged_newest_checkpoint_is_named_and_the_previous_one_used(tmp_path, reference, damage, reason):
    ckpt = _copy_checkpoints(reference, tmp_path)
    bad = ckpt / "step-00000030" / "model.pt"
    damage(bad)
    p = _resume(ckpt)
    assert p.returncode == 0, p.stderr
    rejected = [line for line in p.stderr.splitlines() if line.startswith("dpscale: warning: rejected")]
    assert len(rejected) == 1 and str(bad) in rejected[0] and reason in rejected[0], p.stderr
    out = last_json(p.stdout)
    assert out["resumed_from_step"] == 20
    assert out["param_sha256"] == reference["param_sha256"]


class _RunsCode:
    """Unpickling calls os.system: what a malicious checkpoint would do."""

    def __init__(self, sentinel):
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


def test_pickle_that_runs_code_is_refused_and_never_runs(tmp_path, reference):
    ckpt = _copy_checkpoints(reference, tmp_path)
    sentinel = tmp_path / "code-ran"
    step = ckpt / "step-00000030"
    evil = step / "trainer.pt"
    evil.write_bytes(pickle.dumps({"step": _RunsCode(sentinel)}))
    # the attacker also fixes the manifest, so only weights_only loading stands in the way
    manifest = json.loads((step / "manifest.json").read_text())
    for entry in manifest["files"]:
        if entry["name"] == "trainer.pt":
            entry["size_bytes"] = evil.stat().st_size
            entry["sha256"] = hashlib.sha256(evil.read_bytes()).hexdigest()
    (step / "manifest.json").write_text(json.dumps(manifest))

    p = _resume(ckpt)
    assert p.returncode == 0, p.stderr
    assert not sentinel.exists(), "unpickling ran the attacker's code"
    rejected = [line for line in p.stderr.splitlines() if line.startswith("dpscale: warning: rejected")]
    assert len(rejected) == 1 and str(evil) in rejected[0] and "weights_only" in rejected[0], p.stderr
    out = last_json(p.stdout)
    assert out["resumed_from_step"] == 20 and out["param_sha256"] == reference["param_sha256"]


def test_bad_entries_of_every_kind_are_skipped_and_the_final_saves_replace_them(tmp_path, reference):
    """Issue #14 item 9 through the CLI: a manifest nested too deep for the JSON parser (it raised
    RecursionError) and a plain file where the newest checkpoint was (the final save crashed on it)
    are each named and skipped; the run resumes from step 10, and its saves at 20 and 30 replace
    both, ending with the reference run's parameters."""
    ckpt = _copy_checkpoints(reference, tmp_path)
    (ckpt / "step-00000020" / "manifest.json").write_text("[" * 400_000 + "]" * 400_000)
    shutil.rmtree(ckpt / "step-00000030")
    (ckpt / "step-00000030").write_text("a plain file, not a checkpoint")
    p = _resume(ckpt)
    assert p.returncode == 0, p.stderr
    rejected = [line for line in p.stderr.splitlines() if line.startswith("dpscale: warning: rejected")]
    assert len(rejected) == 2, p.stderr
    assert "step-00000030: is not a directory" in rejected[0]
    assert "step-00000020/manifest.json: unparseable (nested too deeply)" in rejected[1]
    out = last_json(p.stdout)
    assert out["resumed_from_step"] == 10 and out["param_sha256"] == reference["param_sha256"]
    assert sorted(d.name for d in ckpt.iterdir()) == ["step-00000010", "step-00000020", "step-00000030"]
    assert (ckpt / "step-00000030").is_dir()
