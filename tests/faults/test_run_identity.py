"""A checkpoint directory that holds another run (issue #34): before, a fresh run in it pruned its
own checkpoints (keeping the other run's higher steps) and a restart resumed the other run's
newest checkpoint, finishing with its weights and exit 0.

Each checkpoint's manifest names its run; a fresh run on a directory with checkpoints is refused
(exit 2, one line) unless --resume or --start-over; pruning and resuming keep to one run.
"""

import json

import pytest
import torch

from dpscale.cli.main import main
from dpscale.train.checkpoint.files import load_latest, runs_in, save_checkpoint

TRAIN = ["train", "--workload", "synthetic", "--progress", "none", "--checkpoint-every", "2"]


def _dirs(root):
    return sorted(p.name for p in root.iterdir())


def _train(capsys, *args):
    code = main([*TRAIN, *args])
    captured = capsys.readouterr()
    return code, captured.err.strip().splitlines(), captured.out


def test_a_fresh_run_on_another_runs_checkpoints_is_refused_in_one_line(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert _train(capsys, "--max-steps", "4", "--checkpoint-dir", str(ckpt))[0] == 0
    before = _dirs(ckpt)
    code, err, _ = _train(capsys, "--max-steps", "6", "--checkpoint-dir", str(ckpt))
    assert code == 2 and len(err) == 1, err
    assert f"--checkpoint-dir {ckpt} holds the checkpoints of another run" in err[0]
    assert "--resume" in err[0] and "--start-over" in err[0]
    assert _dirs(ckpt) == before


def test_start_over_deletes_the_other_run_and_trains_a_new_one(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert _train(capsys, "--max-steps", "6", "--checkpoint-dir", str(ckpt))[0] == 0
    (old,) = runs_in(ckpt)
    code, err, out = _train(
        capsys, "--max-steps", "4", "--checkpoint-dir", str(ckpt), "--start-over", "--json"
    )
    assert code == 0, err
    runs = runs_in(ckpt)
    assert old not in runs and list(runs.values()) == [[2, 4]]
    assert json.loads(out.splitlines()[-1])["resumed_from_step"] is None


def test_start_over_with_resume_is_refused(tmp_path, capsys):
    code, err, _ = _train(capsys, "--checkpoint-dir", str(tmp_path), "--start-over", "--resume")
    assert code == 2 and len(err) == 1 and "start_over" in err[0], err


def test_resume_continues_the_run_and_keeps_its_id(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert _train(capsys, "--max-steps", "4", "--checkpoint-dir", str(ckpt))[0] == 0
    (run,) = runs_in(ckpt)
    code, err, out = _train(capsys, "--max-steps", "8", "--checkpoint-dir", str(ckpt), "--resume", "--json")
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["resumed_from_step"] == 4
    assert runs_in(ckpt) == {run: [4, 6, 8]}


def test_resume_on_a_directory_that_does_not_exist_starts_fresh(tmp_path, capsys):
    ckpt = tmp_path / "not" / "yet"
    code, err, out = _train(capsys, "--max-steps", "2", "--checkpoint-dir", str(ckpt), "--resume", "--json")
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["resumed_from_step"] is None
    assert _dirs(ckpt) == ["step-00000002"]


def test_resume_with_another_lr_is_refused_in_one_line(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert _train(capsys, "--max-steps", "2", "--lr", "0.1", "--checkpoint-dir", str(ckpt))[0] == 0
    code, err, _ = _train(
        capsys, "--max-steps", "4", "--lr", "0.05", "--checkpoint-dir", str(ckpt), "--resume"
    )
    errors = [line for line in err if line.startswith("dpscale train: error:")]
    assert code == 2 and len(errors) == 1, err
    assert (
        "lr: checkpoint" in errors[0] and "trained with lr 0.1" in errors[0] and "asks for 0.05" in errors[0]
    )
    # the same rate continues
    assert (
        _train(capsys, "--max-steps", "4", "--lr", "0.1", "--checkpoint-dir", str(ckpt), "--resume")[0] == 0
    )


def _payload(value: float) -> dict:
    return {"model": {"w": torch.full((2,), value)}}


def test_pruning_touches_only_this_runs_checkpoints(tmp_path):
    for step in (200, 300):
        save_checkpoint(tmp_path, step, _payload(1.0), keep_last=3, run_id="old")
    for step in (50, 100, 150, 250):
        save_checkpoint(tmp_path, step, _payload(2.0), keep_last=3, run_id="new")
    assert runs_in(tmp_path) == {"old": [200, 300], "new": [100, 150, 250]}


def test_a_restart_loads_only_its_own_runs_checkpoints(tmp_path):
    save_checkpoint(tmp_path, 300, _payload(1.0), run_id="old")
    save_checkpoint(tmp_path, 150, _payload(2.0), run_id="new")
    loaded = load_latest(tmp_path, run_id="new")
    assert loaded is not None and loaded.step == 150 and loaded.run_id == "new"
    assert load_latest(tmp_path, run_id="other") is None  # this run saved nothing yet: a fresh start
    assert load_latest(tmp_path).step == 300  # no run named: the newest, as before


def test_a_checkpoint_written_before_run_ids_belongs_to_one_unnamed_run(tmp_path):
    path = save_checkpoint(tmp_path, 4, _payload(1.0))
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["run_id"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert runs_in(tmp_path) == {"unnamed": [4]}
    assert load_latest(tmp_path, run_id="unnamed").step == 4


def test_a_trusted_checkpoint_is_not_hashed_again_unless_it_changed(tmp_path, monkeypatch):
    import dpscale.train.checkpoint.files as files

    save_checkpoint(tmp_path, 4, _payload(1.0), run_id="r")
    first = load_latest(tmp_path)
    hashed = []
    real = files._sha256
    monkeypatch.setattr(files, "_sha256", lambda p: hashed.append(p.name) or real(p))
    assert load_latest(tmp_path, trusted=first.verified).step == 4
    assert hashed == []
    model = tmp_path / "step-00000004" / "model.pt"
    model.write_bytes(model.read_bytes())  # same bytes, but written since: verified again
    assert load_latest(tmp_path, trusted=first.verified).step == 4
    assert hashed == ["model.pt"]


@pytest.mark.parametrize("run_id", ["", "a/b", "x" * 65])
def test_a_bad_run_id_is_one_line(tmp_path, capsys, run_id):
    code, err, _ = _train(capsys, "--checkpoint-dir", str(tmp_path), "--run-id", run_id)
    assert code == 2 and len(err) == 1 and "run_id" in err[0], err


@pytest.mark.slow
def test_resuming_into_a_checkpoint_that_does_not_fit_is_one_line_exit_2_without_restarts(tmp_path):
    from support.cli_runs import run_cli

    ckpt = tmp_path / "ckpt"
    common = [
        "train",
        "--nproc",
        "2",
        "--global-batch",
        "32",
        "--lr",
        "0.1",
        "--max-steps",
        "2",
        "--progress",
        "none",
    ]
    first = run_cli([*common, "--workload", "synthetic", "--checkpoint-dir", str(ckpt)])
    assert first.returncode == 0, first.stderr
    p = run_cli(
        [*common, "--workload", "mlp", "--checkpoint-dir", str(ckpt), "--resume", "--max-restarts", "3"]
    )
    errors = [line for line in p.stderr.splitlines() if "error" in line.lower()]
    assert p.returncode == 2, p.stderr
    assert len(errors) == 1 and errors[0].startswith("dpscale train: error:"), p.stderr
    assert "does not fit this run" in errors[0], p.stderr
    assert "Traceback" not in p.stderr
