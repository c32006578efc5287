"""`dpscale run` and `dpscale scale` on unmodified scripts in nanoGPT's and PyTorch's DDP-tutorial
style (examples/), and the step telemetry they read from inside the engine."""

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from dpscale.cli.main import main
from dpscale.engine.telemetry import TelemetryDDP, TorchTelemetryDDP
from dpscale.lab.multirank import run_ranks
from dpscale.lab.predict.profile import ModelProfile

# slow: starts processes (spawned ranks or the CLI). On a second torch release (compat) run the
# tests of what meets torch itself: the telemetry inside its DDP, the scripts' DDP under `run`
# and `scale`, torch's own DDP; the checks and the diagnosis above them are dpscale's alone
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NANOGPT = str(ROOT / "examples" / "nanogpt_style.py")
TUTORIAL = str(ROOT / "examples" / "ddp_tutorial_style.py")
DPSCALE = [sys.executable, "-m", "dpscale.cli.main"]


def run(args, cwd, timeout=300):
    return subprocess.run(DPSCALE + args, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def _steps_with_accumulation(rank, world, engine, limit):
    """3 steps of 2 micro-batches (batch 4 then 6), nanoGPT's toggle for the first, no_sync() after."""
    torch.manual_seed(0)
    cls = TelemetryDDP if engine == "dpscale" else TorchTelemetryDDP
    model = cls(nn.Linear(3, 1))
    stops = []
    model.telemetry.limit = limit
    model.telemetry.on_limit = lambda t: stops.append(len(t.records))
    for step in range(4):
        for micro, batch in enumerate((4, 6)):
            last = micro == 1
            if step == 0:
                model.require_backward_grad_sync = last
                ctx = contextlib.nullcontext()
            else:
                model.require_backward_grad_sync = True
                ctx = contextlib.nullcontext() if last else model.no_sync()
            with ctx:
                model(torch.randn(batch, 3)).sum().backward()
        with torch.no_grad():
            model.eval()
            model(torch.randn(50, 3))  # an evaluation pass is not a training step
            model.train()
    if engine == "dpscale":
        model.close()
    return [(r.samples, r.micro_steps, r.exposed_comm_ms is not None) for r in model.telemetry.records], stops


@pytest.mark.compat
@pytest.mark.parametrize("engine", ["dpscale", "torch"])
def test_telemetry_counts_synchronized_steps_and_samples_the_same_on_every_rank(engine):
    results = run_ranks(_steps_with_accumulation, 2, engine, 2)
    for records, stops in results:
        # steps end at the next step's first forward: 4 steps -> 3 complete records
        assert records == [(10, 2, True)] * 3
        assert stops == [2]  # the limit fired once, at the same step on both ranks


@pytest.mark.compat
@pytest.mark.slow
def test_run_puts_dpscales_engine_under_an_unchanged_tutorial_script(tmp_path):
    p = run(["run", "--nproc", "2", TUTORIAL, "1", "1", "--batch_size", "64"], cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "dpscale: transport shm (2 workers" in p.stderr  # the stand-in, not torch's DDP
    assert "Epoch 0 | Training snapshot saved" in p.stdout and (tmp_path / "snapshot.pt").is_file()


@pytest.mark.compat
@pytest.mark.slow
def test_scale_measures_a_nanogpt_style_script_and_writes_a_report_predict_reads(tmp_path, monkeypatch):
    p = run(
        [
            "scale",
            "--nproc",
            "1,2",
            "--steps",
            "15",
            "--warmup",
            "2",
            "--json",
            "--report-dir",
            "reports",
            "--",
            NANOGPT,
            "--eval_interval=1000",
        ],
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout.strip().splitlines()[-1])
    assert [(r["world_size"], r["engine"], r["steps"]) for r in rows] == [
        (1, "dpscale", 15),
        (2, "dpscale", 15),
    ]
    assert set(rows[0]) == {
        "world_size",
        "engine",
        "hosts",
        "steps",
        "step_ms",
        "samples_per_s",
        "efficiency",
        "exposed_comm_ms",
    }
    assert rows[0]["efficiency"] == 1.0 and 0 < rows[1]["efficiency"] < 1.5
    assert [r["hosts"] for r in rows] == [1, 1]
    (report,) = (tmp_path / "reports").iterdir()
    doc = json.loads((report / "report.json").read_text())
    # nanoGPT keeps the global batch: 4 micro-steps x 8 at N=1, 2 x 8 on each of 2 ranks at N=2
    assert [pt["samples_per_step"] for pt in doc["results"]["points"]] == [32, 32]
    assert {"report.md", "scale.png", "scale.csv", "profile.json", "dpscale-2.log"} <= {
        f.name for f in report.iterdir()
    }
    profile = ModelProfile.load(report / "profile.json")
    assert profile.per_worker_batch == 32 and profile.backward_ms > 0 and profile.param_count > 0
    # re-rendering and predicting start no worker: in this process (two torch imports fewer)
    monkeypatch.chdir(tmp_path)
    (report / "report.md").unlink()
    assert main(["report", str(report)]) == 0 and (report / "report.md").is_file()
    predict = ["predict", "--profile", str(report / "profile.json"), "--preset", "dgx-a100", "--nodes", "2"]
    assert main(predict) == 0


@pytest.mark.compat
@pytest.mark.slow
def test_scale_takes_torchs_own_ddp_too(tmp_path):
    p = run(
        [
            "scale",
            "--nproc",
            "2",
            "--steps",
            "5",
            "--warmup",
            "1",
            "--engine",
            "torch",
            "--json",
            "--",
            TUTORIAL,
            "1",
            "1",
        ],
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr
    (row,) = json.loads(p.stdout.strip().splitlines()[-1])
    assert row["engine"] == "torch" and row["exposed_comm_ms"] is not None and row["efficiency"] is None
    assert row["samples_per_s"] > 0


@pytest.mark.slow
def test_scale_refuses_more_steps_than_the_script_runs(tmp_path):
    p = run(["scale", "--nproc", "1", "--steps", "50", "--", NANOGPT, "--max_iters=5"], cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    (line,) = p.stderr.strip().splitlines()[-1:]
    assert "ran 5 synchronized steps with 1 worker, fewer than --warmup 3 + --steps 50" in line
    assert not (tmp_path / "reports").exists()


@pytest.mark.slow
def test_the_scripts_arguments_reach_it_even_where_torchrun_would_take_them_for_its_own(tmp_path):
    # torchrun's parser read `--nproc` and `--log` after the script as abbreviations of its own
    # --nproc-per-node and --log-dir ("ambiguous option"); the script never started
    script = tmp_path / "echo_args.py"
    script.write_text("import json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    args = ["--nproc", "5", "--log", "x", "--", "y"]
    p = run(["run", "--nproc", "1", str(script), *args], cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1]) == args


SCRIPTS = Path(__file__).resolve().parent / "scripts"


@pytest.mark.slow
def test_run_says_in_one_line_when_the_script_built_no_ddp_model(tmp_path):
    # pytorch/examples' imagenet main.py on CPU wraps nothing: each rank trained alone, exit 0, silence
    script = str(SCRIPTS / "wrap_if_distributed.py")
    p = run(["run", "--nproc", "2", script, "--steps", "3", "--never-wrap"], cwd=tmp_path, timeout=180)
    assert p.returncode == 0, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert (
        "built no torch.nn.parallel.DistributedDataParallel model" in last and "did not synchronize" in last
    )
    wrapped = run(["run", "--nproc", "2", script, "--steps", "3"], cwd=tmp_path, timeout=180)
    assert wrapped.returncode == 0, wrapped.stderr
    assert "did not synchronize" not in wrapped.stderr


@pytest.mark.slow
def test_scale_measures_one_worker_without_ddp_and_each_ranks_phases_add_up(tmp_path):
    # "wrap in DDP only when world_size > 1": scale failed after the whole N=1 run ("0 of 1 ranks
    # wrapped a model"); every 5th step evaluates and every 7th saves a checkpoint
    script = str(SCRIPTS / "wrap_if_distributed.py")
    args = ["--eval-every", "5", "--save-every", "7"]
    cmd = [
        "scale",
        "--nproc",
        "1,2",
        "--steps",
        "14",
        "--warmup",
        "2",
        "--report-dir",
        "r",
        "--",
        script,
        *args,
    ]
    p = run(cmd, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    (report,) = (tmp_path / "r").iterdir()
    points = json.loads((report / "report.json").read_text())["results"]["points"]
    one, two = points
    assert one["transport"] == "none" and "no DDP model at 1 worker" in one["note"]
    assert two["synchronized"] and two["efficiency"] is not None
    for pt in points:
        assert pt["eval_steps"] >= 2 and pt["checkpoint_steps"] >= 1
        assert len(pt["phases"]) == pt["world_size"]
        assert all(rank["sum_error"] <= 0.05 for rank in pt["phases"])  # the phases add up to the step
    assert {"phases.csv", "phases.png", "scale.csv"} <= {f.name for f in report.iterdir()}


@pytest.mark.slow
def test_scale_classifies_the_evaluations_a_trainer_style_script_runs_past_its_ddp_model(tmp_path):
    # Hugging Face's Trainer evaluates the module its DDP model wraps: at N=2 those steps were timed
    # as training steps, their evaluation booked as data wait
    script = str(SCRIPTS / "trainer_style.py")
    cmd = ["scale", "--nproc", "1,2", "--steps", "12", "--warmup", "2", "--report-dir", "r", "--", script]
    p = run([*cmd, "--eval-every", "4"], cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    (report,) = (tmp_path / "r").iterdir()
    one, two = json.loads((report / "report.json").read_text())["results"]["points"]
    for pt in (one, two):
        assert pt["eval_steps"] >= 2 and "held an evaluation" in pt["note"], pt
    assert two["synchronized"] and two["checks"] == []  # its micro-steps skip the sync: nothing to say


@pytest.mark.slow
def test_scale_names_the_rank_that_sleeps_30_ms_in_every_forward(tmp_path):
    script = str(SCRIPTS / "slow_rank_forward.py")
    p = run(
        ["scale", "--nproc", "2", "--steps", "12", "--warmup", "2", "--report-dir", "r", "--", script],
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr
    (report,) = (tmp_path / "r").iterdir()
    (point,) = json.loads((report / "report.json").read_text())["results"]["points"]
    (named,) = [s for s in point["stragglers"] if s["cause"] == "compute"]
    assert named["rank"] == 1 and named["excess_ms"] == pytest.approx(30.0, abs=10.0)
    assert "rank 1 compute +" in p.stdout and "a straggler" in p.stdout


@pytest.mark.slow
def test_scale_says_when_the_script_all_reduces_on_every_accumulation_micro_step(tmp_path):
    script = str(SCRIPTS / "accumulate_every_micro_step.py")
    p = run(["scale", "--nproc", "2", "--steps", "8", "--warmup", "4", "--json", "--", script], cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "all-reduce on every micro-step: 4 synced backwards per optimizer step" in p.stdout


@pytest.mark.compat
@pytest.mark.slow
def test_run_says_what_to_change_for_accumulation_without_no_sync(tmp_path):
    script = str(SCRIPTS / "accumulate_every_micro_step.py")
    p = run(["run", "--nproc", "2", script, "--steps", "4"], cwd=tmp_path, timeout=180)
    assert p.returncode == 0, p.stderr
    (line,) = [ln for ln in p.stderr.splitlines() if "all-reduce on every micro-step" in ln]
    assert "4 synced backwards per optimizer step" in line and "model.no_sync()" in line
    # the same script skipping the syncs (Accelerate's way) is fine
    fine = run(
        ["run", "--nproc", "2", script, "--steps", "4", "--no-sync-when-distributed"],
        cwd=tmp_path,
        timeout=180,
    )
    assert fine.returncode == 0 and "all-reduce on every micro-step" not in fine.stderr


@pytest.mark.slow
def test_run_turns_batch_norm_and_the_engines_unused_parameter_error_into_advice(tmp_path):
    script = str(SCRIPTS / "examples_style.py")
    p = run(["run", "--nproc", "2", script, "--batch-norm", "--unused-layer"], cwd=tmp_path, timeout=180)
    assert p.returncode != 0  # the engine refuses the unused layer, as torch's DDP does
    last = p.stderr.strip().splitlines()[-2:]
    assert any("BatchNorm without SyncBatchNorm (body.1)" in ln for ln in last), p.stderr
    assert any(
        "aux_head.weight, aux_head.bias" in ln and "find_unused_parameters=True" in ln for ln in last
    ), p.stderr


@pytest.mark.slow
def test_scale_checks_the_learning_rate_and_tries_engine_fixes_predicted_next_to_measured(tmp_path):
    script = str(SCRIPTS / "examples_style.py")
    tries = ["--try", "fp16,accumulation=2"]
    cmd = [
        "scale",
        "--nproc",
        "1,2",
        "--steps",
        "6",
        "--warmup",
        "1",
        *tries,
        "--report-dir",
        "r",
        "--",
        script,
    ]
    p = run(cmd, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "check: learning rate unchanged (0.05 at the first optimizer step) at N=1 and N=2" in p.stdout
    assert "--try at N=2: efficiency without a fix" in p.stdout
    for fix in ("fp16 compression", "accumulation 2"):
        (line,) = [ln for ln in p.stdout.splitlines() if ln.startswith(f"  {fix}: predicted ")]
        assert "measured " in line and "%" in line
    (report,) = (tmp_path / "r").iterdir()
    doc = json.loads((report / "report.json").read_text())["results"]
    assert [t["note"] for t in doc["tries"]] == ["fp16", "accumulation=2"]
    # accumulation=2: one all-reduce per 2 steps, so twice the samples per measured step
    assert doc["tries"][1]["samples_per_step"] == 2 * doc["points"][1]["samples_per_step"]
    assert "## Diagnosis" in (report / "report.md").read_text()
