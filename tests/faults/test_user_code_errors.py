"""The user's own code misbehaves (issue #34): a raise, a sys.exit or a wrong type in their Task
or module ends `dpscale train` with exit 2; the first line names what failed (`Task.model()`,
`forward`, the import of `mytask`), then come the frames of the user's own files, and only those.

In process through `dpscale.cli.main.main`: preflight refuses each before any worker starts.
"""

import sys
from pathlib import Path

import pytest

from dpscale.cli.main import main

TASKS = Path(__file__).resolve().parents[1] / "train"  # user_tasks.py


@pytest.fixture
def user_dir(monkeypatch):
    monkeypatch.chdir(TASKS)
    monkeypatch.syspath_prepend(str(TASKS))


def _train(capsys, *args):
    code = main(["train", "--max-steps", "2", "--progress", "none", *args])
    return code, capsys.readouterr().err.strip().splitlines()


def _only_user_frames(lines, filename):
    frames = [line for line in lines if line.startswith("  File ")]
    assert frames, lines
    assert all(filename in line for line in frames), lines


@pytest.mark.parametrize(
    "name, first",
    [
        ("forward_raises", "forward of Task.model() on train_data raised KeyError: 'no such head'"),
        ("model_raises", "Task.model() raised RuntimeError: no such layer size"),
    ],
)
def test_a_raise_in_the_task_names_the_call_and_shows_only_the_users_frames(user_dir, capsys, name, first):
    code, err = _train(capsys, "--task", f"user_tasks:{name}")
    assert code == 2
    assert first in err[0], err
    _only_user_frames(err[1:], "user_tasks.py")
    assert err[-1].startswith(("KeyError", "RuntimeError")), err


def test_a_forward_returning_a_string_is_one_line(user_dir, capsys):
    code, err = _train(capsys, "--task", "user_tasks:forward_returns_str")
    assert code == 2 and len(err) == 1, err
    assert "forward of Task.model() on train_data returned str, which holds no tensor" in err[0]


def test_a_model_without_parameters_is_caught_before_any_worker(user_dir, capsys):
    code, err = _train(capsys, "--task", "user_tasks:no_parameters", "--nproc", "2")
    assert code == 2 and len(err) == 1, err
    assert "Task.model() built a NoParameters with no trainable parameters" in err[0]


def test_make_calling_sys_exit_0_is_exit_2_never_a_silent_success(user_dir, capsys):
    code, err = _train(capsys, "--task", "user_tasks:exits_in_make", "--json")
    assert code == 2, err
    assert "user_tasks:exits_in_make() called sys.exit(0)" in err[0]
    _only_user_frames(err[1:], "user_tasks.py")


def test_a_module_that_raises_at_import_names_the_import(tmp_path, monkeypatch, capsys):
    (tmp_path / "mytask.py").write_text(
        "import json\n\ndef load():\n    return json.loads('{')\n\nDATA = load()\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mytask", raising=False)
    code, err = _train(capsys, "--task", "mytask:make")
    assert code == 2
    assert "--task: the import of mytask raised JSONDecodeError" in err[0], err
    _only_user_frames(err[1:], "mytask.py")
    assert len([line for line in err if line.startswith("  File ")]) == 2  # <module>, then load()


def test_a_module_that_exits_at_import_is_exit_2(tmp_path, monkeypatch, capsys):
    (tmp_path / "exittask.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "exittask", raising=False)
    code, err = _train(capsys, "--task", "exittask:make")
    assert code == 2 and "the import of exittask called sys.exit(0)" in err[0], err


def test_a_missing_module_is_still_the_one_line_naming_the_convention(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, err = _train(capsys, "--task", "no_such_module_here:make")
    assert code == 2 and len(err) == 1 and "cannot load 'no_such_module_here:make'" in err[0], err


def test_sys_exit_during_in_process_training_is_never_exit_0(monkeypatch, capsys):
    from dpscale.train.trainer import Trainer

    def exits(self):
        sys.exit(0)

    monkeypatch.setattr(Trainer, "fit", exits)
    code, err = _train(capsys, "--workload", "synthetic")
    assert code == 2, err
    assert any(line.startswith("dpscale train: error:") and "called sys.exit(0)" in line for line in err), err
