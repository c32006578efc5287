"""SIGTERM (a preempting scheduler) or SIGINT (Ctrl-C) to `dpscale train`: the workers stop after the
same step, save a checkpoint, and the launcher exits 143 (130) with one line; `--resume` then ends
bit for bit where a run that was never stopped ends.

Before, the launcher printed torch's SignalException traceback and exited 1, without a checkpoint.
"""

import signal

import pytest

from support.cli_runs import TRAIN, StderrWatch, last_json, run_cli, start_cli, wait_until_gone
from support.timing import process_baseline_once_s

pytestmark = pytest.mark.slow  # starts processes (spawned ranks or the CLI)

STEPS = "200"
# long enough that the signal arrives well before the end, short enough for a few seconds' run
RUN = [a if a != "30" else STEPS for a in TRAIN] + ["--log-every", "10"]


def _stop_with(sig, args, after="step 20/"):
    proc, tag = start_cli(args)
    watch = StderrWatch(proc)
    watch.wait_for(after)
    proc.send_signal(sig)
    out = proc.stdout.read()  # stderr is the watch's to read
    proc.wait(timeout=120)
    assert not wait_until_gone(tag, 2 * process_baseline_once_s())
    return proc.returncode, out, watch.text()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    p = run_cli(RUN + ["--checkpoint-dir", str(tmp_path_factory.mktemp("ref") / "ckpt")])
    assert p.returncode == 0, p.stderr
    return last_json(p.stdout)


@pytest.mark.slow  # three CLI runs; the fast tier keeps the in-process SIGINT test
def test_sigterm_checkpoints_exits_143_and_resume_is_bit_exact(tmp_path, uninterrupted):
    ckpt = tmp_path / "ckpt"
    code, out, err = _stop_with(signal.SIGTERM, RUN + ["--checkpoint-dir", str(ckpt)])
    assert code == 143, err
    stopped = last_json(out)
    step = stopped["steps"]
    assert stopped["stopped_by"] == "SIGTERM" and 20 <= step < int(STEPS), stopped
    line = f"dpscale train: stopped by SIGTERM after step {step}; checkpoint {ckpt}/step-{step:08d}"
    assert line in err.splitlines()[-1], err
    assert "Traceback" not in err and "SignalException" not in err, err
    assert (ckpt / f"step-{step:08d}" / "manifest.json").is_file()

    p = run_cli(RUN + ["--checkpoint-dir", str(ckpt), "--resume"])
    assert p.returncode == 0, p.stderr
    resumed = last_json(p.stdout)
    assert resumed["resumed_from_step"] == step and resumed["steps"] == int(STEPS)
    assert resumed["param_sha256"] == uninterrupted["param_sha256"]


def test_sigint_in_process_exits_130_with_a_checkpoint(tmp_path):
    """One worker runs inside the CLI process: Ctrl-C stops it the same way."""
    ckpt = tmp_path / "ckpt"
    args = RUN[:1] + ["--nproc", "1"] + RUN[3:] + ["--checkpoint-dir", str(ckpt)]
    code, out, err = _stop_with(signal.SIGINT, args)
    assert code == 130, err
    step = last_json(out)["steps"]
    assert err.splitlines()[-1].startswith(f"dpscale train: stopped by SIGINT after step {step}; checkpoint")
    assert "Traceback" not in err and (ckpt / f"step-{step:08d}").is_dir()
