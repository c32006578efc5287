"""Scenario 12: bad command-line input is one line on stderr, exit code 2, and nothing written.

Checked in-process through `dpscale.cli.main.main` (fast), and once as a real subprocess so the exit
code and the single line are what a shell sees.
"""

import subprocess
from pathlib import Path

import pytest

from dpscale.cli.main import main
from support.cli_runs import run_cli


@pytest.mark.parametrize(
    "args,words",
    [
        (["--global-batch", "-4"], "global_batch must be a positive integer, got -4"),
        (["--micro-batch", "-1"], "micro_batch must be a positive integer"),
        (["--nproc", "4", "--global-batch", "2"], "world size 4 is larger than global_batch 2"),
        (["--nproc", "1:3", "--global-batch", "64"], "multiple of 3"),
        (["--nproc", "3:2"], "--nproc must be N or MIN:MAX with 1 <= MIN <= MAX, got '3:2'"),
        (["--nproc", "0"], "--nproc must be N or MIN:MAX"),
        (["--nproc", "two"], "--nproc must be N or MIN:MAX"),
        (["--max-restarts", "-1"], "--max-restarts must be >= 0"),
        (["--collective-timeout-s", "0"], "collective_timeout_s must be between 1 and 604800 seconds"),
        # issue #14 item 7: each of these used to be caught inside the workers or after training
        (["--collective-timeout-s", "1e15"], "collective_timeout_s must be between 1 and 604800 seconds"),
        (["--threads", "-1"], "--threads must be >= 1"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--seed", str(2**62)], "seed must be at most 2**32 - 1"),
        (["--seed", str(2**64)], "seed must be at most 2**32 - 1"),
        (["--checkpoint-every", "5", "NO_CHECKPOINT_DIR"], "checkpoint_every needs checkpoint_dir"),
        (["--metrics-dir", "FILE"], "--metrics-dir FILE is a file, not a directory"),
        (["--checkpoint-dir", "FILE/ckpt"], "cannot be created: FILE is a file"),
        (["--checkpoint-dir", "FILE"], "--checkpoint-dir FILE is a file"),
        (
            ["--workload", "synthetic", "--global-batch", "1000000", "--nproc", "2"],
            "train_data has 8192 samples, fewer than one global batch",
        ),
        (
            ["--workload", "synthetic", "--global-batch", str(10**12), "--tail", "pad"],
            "train_data has 8192 samples, fewer than one global batch",
        ),
        (["--transport", "nccl"], "--transport nccl needs CUDA"),
        (["--engine", "torch", "--transport", "shm"], "transport 'shm' is dpscale's own"),
        (["--drift-check-every", "-5"], "drift_check_every must be >= 0"),
        (["--check-collectives-steps", "-1"], "check_collectives_steps must be >= 0"),
        (["--workload", "cifar"], "unknown 'cifar'"),
        (["--nproc", "3", "--global-batch", "64"], "multiple of 3"),
        (["--resume", "--start-over", "--checkpoint-dir", "MISSING"], "start_over"),
        (["--micro-batch", "5"], "divisor of 64"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, args, words):
    (tmp_path / "file").write_text("not a directory")
    file = str(tmp_path / "file")
    args = [a.replace("MISSING", str(tmp_path / "nope")).replace("FILE", file) for a in args]
    words = words.replace("FILE", str(tmp_path / "file"))
    if "--checkpoint-dir" not in args and "NO_CHECKPOINT_DIR" not in args:
        args += ["--checkpoint-dir", str(tmp_path / "ckpt")]
    if "--metrics-dir" not in args:
        args += ["--metrics-dir", str(tmp_path / "metrics")]
    code = main(["train", *[a for a in args if a != "NO_CHECKPOINT_DIR"]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("dpscale train: error: ") and words in err[0], err
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


# issue 34: a count past what the host can hold was accepted: `--threads 100000` started threads
# until the host's process limit (fork failed elsewhere), then died with SIGSEGV
@pytest.mark.parametrize(
    "args,words",
    [
        (
            ["--threads", "100000"],
            "--threads must be at most 8 (4 x the 2 cores this process may use), got 100000",
        ),
        (["--threads", "9"], "--threads must be at most 8"),
        (["--nproc", "9"], "--nproc must be at most 8 (4 x the 2 cores"),
        (["--nproc", "1:100000"], "--nproc must be at most 8"),
        (["--data-workers", "100000"], "data_workers (processes per training worker) must be at most 8"),
        (["--bucket-cap-mb", "1e-9"], "bucket_cap_mb must be at least one byte (1/1048576 MB), got 1e-09"),
    ],
)
def test_counts_past_what_the_host_holds_are_one_line_before_any_worker_starts(
    capsys, monkeypatch, args, words
):
    monkeypatch.setattr("dpscale.cores.usable_cores", lambda: 2)
    monkeypatch.setattr("dpscale.launch.launcher.launch", lambda *a, **k: pytest.fail("a worker was started"))
    code = main(["train", "--workload", "synthetic", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("dpscale train: error: ") and words in err[0], err


def test_the_host_bounds_take_counts_up_to_four_per_core(monkeypatch):
    from dpscale.launch.options import LaunchOptions
    from dpscale.train.config import DataConfig

    monkeypatch.setattr("dpscale.cores.usable_cores", lambda: 2)
    assert LaunchOptions(threads=8, nproc="1:8").nproc_range == (1, 8)
    assert DataConfig(data_workers=8).data_workers == 8


@pytest.mark.slow
def test_too_many_threads_from_a_shell_is_one_line_and_starts_nothing(tmp_path):
    p = run_cli(["train", "--threads", "100000", "--checkpoint-dir", str(tmp_path / "c")])
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1 and "--threads must be at most" in p.stderr
    assert p.stdout == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "flag", ["--lr", "--weight-decay", "--bucket-cap-mb", "--momentum", "--grad-clip-norm"]
)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_numbers_are_refused_while_parsing(capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        main(["train", f"{flag}={value}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert f"argument {flag}: '{value}' is not a finite number" in err[0]


def test_non_finite_numbers_are_refused_by_the_config_too():
    from dpscale.train.config import TrainConfig

    floats = ("lr", "weight_decay", "bucket_cap_mb", "grad_clip_norm", "momentum", "collective_timeout_s")
    for field in floats:
        with pytest.raises(ValueError, match=f"{field} must be a finite number"):
            TrainConfig.from_flat(**{field: float("nan")})


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only mount (tmpfs -o ro); needs the right to mount, which root in a container has."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mnt)], capture_output=True)
    if p.returncode:
        pytest.skip(f"cannot mount a read-only file system here: {p.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.parametrize("flag", ["--checkpoint-dir", "--metrics-dir"])
@pytest.mark.parametrize("below", ["", "sub"])
@pytest.mark.slow
def test_a_read_only_mount_is_refused_before_training(tmp_path, capsys, read_only_dir, flag, below):
    target = read_only_dir / below if below else read_only_dir
    code = main(["train", "--workload", "synthetic", "--max-steps", "2", flag, str(target)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"{flag} {target}" in err[0] and "not writable (read-only mount or permissions)" in err[0]


def test_resume_with_nothing_to_resume_from_says_so(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    args = ["train", "--workload", "synthetic", "--max-steps", "2", "--progress", "none"]
    assert main([*args, "--checkpoint-dir", str(ckpt), "--resume"]) == 0
    assert f"dpscale: --resume: no checkpoint in {ckpt} yet; starting from step 0" in capsys.readouterr().err


@pytest.mark.slow
def test_bad_input_from_a_shell(tmp_path):
    p = run_cli(["train", "--nproc", "4", "--global-batch", "2", "--checkpoint-dir", str(tmp_path / "c")])
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1 and "larger than global_batch" in p.stderr
    assert p.stdout == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args",
    [
        ["predict", "--intra-bw-GBps=nan"],
        ["bench", "convergence", "--tolerance=inf"],
        ["predict", "--bucket-mb=-inf"],
    ],
)
def test_every_float_flag_of_every_command_refuses_non_finite_numbers(capsys, args):
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "is not a finite number" in err[0], err


def _train_in_process(ckpt, *extra):
    args = ["train", "--workload", "synthetic", "--max-steps", "2", "--progress", "none"]
    assert main([*args, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", *extra]) == 0


def test_resume_with_another_global_batch_is_refused_before_any_worker_starts(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    _train_in_process(ckpt, "--global-batch", "64")
    before = sorted(p.name for p in ckpt.iterdir())
    capsys.readouterr()
    args = ["train", "--workload", "synthetic", "--nproc", "2", "--global-batch", "32", "--resume"]
    code = main([*args, "--checkpoint-dir", str(ckpt), "--progress", "none"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"checkpoint {ckpt}/step-00000002 was trained with global_batch 64, this run asks for 32" in err[0]
    assert sorted(p.name for p in ckpt.iterdir()) == before


def test_resume_when_every_checkpoint_is_damaged_is_one_line_naming_them(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    _train_in_process(ckpt)
    for step in ckpt.glob("step-*"):
        (step / "model.pt").write_bytes(b"damaged")
    capsys.readouterr()
    args = ["train", "--workload", "synthetic", "--nproc", "2", "--resume", "--progress", "none"]
    code = main([*args, "--checkpoint-dir", str(ckpt)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"no valid checkpoint under {ckpt}" in err[0]
    assert f"{ckpt}/step-00000002/model.pt: size 7 bytes" in err[0]
    assert f"{ckpt}/step-00000001/model.pt" in err[0]


@pytest.mark.parametrize(
    "args, measure",
    [
        (["bench", "allreduce", "--sizes", "4", "--report-dir", "FILE"], "lab.bench.allreduce.run"),
        (["bench", "scaling", "--nproc", "1", "--report-dir", "FILE/sub"], "lab.bench.scaling.run"),
        (["bench", "convergence", "--report-dir", "FILE"], "lab.bench.convergence.run"),
        (["bench", "engine", "--models", "digits", "--report-dir", "FILE"], "lab.bench.engines.run"),
        (["study", "--quick", "--report-dir", "FILE"], "lab.bench.study.run"),
        (
            ["scale", "--nproc", "1", "--report-dir", "FILE", "--", "SCRIPT"],
            "lab.bench.script_scaling.measure",
        ),
        (["predict", "--model", "digits", "--report-dir", "FILE"], "lab.predict.profiling.measure"),
        (["profile", "--model", "digits", "--out", "FILE/p.json"], "lab.predict.profiling.measure"),
        (["profile", "--model", "digits", "--out", "DIR"], "lab.predict.profiling.measure"),
    ],
)
def test_an_output_location_that_cannot_be_written_is_refused_before_measuring(
    tmp_path, capsys, monkeypatch, args, measure
):
    import importlib

    def measured(*a, **k):
        raise AssertionError("measured before checking where the results go")

    module, _, name = f"dpscale.{measure}".rpartition(".")
    monkeypatch.setattr(importlib.import_module(module), name, measured)
    (tmp_path / "file").write_text("not a directory")
    (tmp_path / "script.py").write_text("print('hi')\n")
    subs = {"FILE": str(tmp_path / "file"), "DIR": str(tmp_path), "SCRIPT": str(tmp_path / "script.py")}
    argv = [a.replace("FILE", subs["FILE"]) if a.startswith("FILE") else subs.get(a, a) for a in args]
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    flag = "--out" if "--out" in args else "--report-dir"
    assert f"error: {flag} " in err[0] and str(tmp_path) in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "script.py"]


@pytest.mark.parametrize(
    "flags", [["--lr", "0"], ["--optimizer", "adamw"], ["--momentum", "0", "--weight-decay", "0.1"]]
)
def test_optimizer_flags_with_a_task_that_builds_its_optimizer_are_refused(capsys, monkeypatch, flags):
    # they used to be ignored in silence: `--lr 0` (a measurement run) trained at the task's rate
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "train"))  # user_tasks.py
    code = main(["train", "--task", "user_tasks:tensor_task", "--max-steps", "1", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    named = [f for f in flags if f.startswith("--")]
    assert f"{', '.join(named)}: the task builds its own optimizer (Task.optimizer)" in err[0], err


def test_a_grown_auto_batch_checkpoint_passes_the_launchers_resume_check(tmp_path, monkeypatch):
    # the launcher checks the checkpoint a --resume would take before any worker starts; a run
    # whose batch grew under --global-batch auto must pass there with auto, and only with auto
    import types

    from dpscale.launch import preflight
    from dpscale.train.config import TrainConfig
    from dpscale.train.state import TrainState

    grown = TrainState(
        world_size=2, global_batch=256, base_global_batch=64, micro_batch=32, accumulation_steps=4
    )
    grown.batch_growth = {"changes": [[8, 128], [12, 256]], "fastest_s": {1: 0.01}}
    found = types.SimpleNamespace(payload={"trainer": grown.state_dict()}, path=tmp_path / "step-00000016")
    monkeypatch.setattr(preflight, "load_latest", lambda *a, **k: found)
    common = dict(workload="digits", checkpoint_dir=str(tmp_path), resume=True)
    preflight.check_resume_point(TrainConfig.from_flat(global_batch="auto", **common))
    with pytest.raises(
        ValueError, match="had grown to global batch 256 under global_batch auto; resume with"
    ):
        preflight.check_resume_point(TrainConfig.from_flat(global_batch=64, **common))
