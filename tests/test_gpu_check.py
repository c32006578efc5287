"""scripts/gpu-check.sh, its bench and its report, checked on CPU: the script parses, the bench's
arithmetic and JSON are right (its functions called in this process, tiny sizes, gloo), and the
report fails a run whose stages or results are wrong."""

import importlib.util
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _bench():
    return _script("gpu_engine_bench")


@pytest.mark.slow  # starts bash
def test_the_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu-check.sh")], check=True)


def test_engines_alternate_and_each_goes_first_as_often():
    b = _bench()
    assert b.alternate(("dpscale", "torch"), 4) == ["dpscale", "torch", "torch", "dpscale"] * 2


def test_the_figures_are_medians_spreads_and_the_ratio_of_medians():
    b = _bench()
    rounds = [
        b.Round("dpscale", 10.0, 2.0),
        b.Round("torch", 10.0, 1.0),
        b.Round("torch", 9.0, 1.0),
        b.Round("dpscale", 12.0, 4.0),
        b.Round("dpscale", 11.0, 3.0),
        b.Round("torch", 11.0, 1.0),
    ]
    got = b.summarize(rounds, {"dpscale": 0.0, "torch": None}, b.BenchConfig.tiny())
    mine = got["engines"]["dpscale"]
    assert mine["step_ms"] == {"median": 11.0, "min": 10.0, "max": 12.0, "spread": pytest.approx(2 / 11)}
    assert mine["cpu_ms_per_step"]["median"] == 3.0 and mine["syncs_per_step"] == 0.0
    assert mine["rounds_step_ms"] == [10.0, 12.0, 11.0]
    assert got["engines"]["torch"]["syncs_per_step"] is None
    assert got["ratio_dpscale_torch"] == pytest.approx(11 / 10)
    assert got["ratio_per_round_median"] == pytest.approx(1.0)  # 10/10, 12/9, 11/11
    assert got["target_ratio"] == 1.02 and got["within_target"] is False


def test_the_bench_model_has_about_120m_parameters():
    b = _bench()
    with torch.device("meta"):
        model = b.Decoder(b.BenchConfig())
    assert 110e6 < b.param_count(model) < 130e6


def test_a_dry_run_writes_the_documented_json(tmp_path):
    b = _bench()
    assert b.main(["--dry-run", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "engine-bench.json").read_text())
    assert doc["backend"] == "gloo" and doc["world_size"] == 1 and doc["device"] == "cpu"
    assert doc["params"] > 0 and doc["config"]["device"] == "cpu"
    for engine in ("dpscale", "torch"):
        e = doc["engines"][engine]
        assert len(e["rounds_step_ms"]) == doc["config"]["rounds"]
        assert e["step_ms"]["median"] > 0 and e["cpu_ms_per_step"]["median"] >= 0
        assert e["syncs_per_step"] is None  # nothing synchronizes a device on a CPU
    assert doc["ratio_dpscale_torch"] == pytest.approx(
        doc["engines"]["dpscale"]["step_ms"]["median"] / doc["engines"]["torch"]["step_ms"]["median"]
    )
    assert set(doc) >= {"torch", "cuda", "within_target", "target_ratio", "ratio_per_round_median"}


def test_the_bench_refuses_a_bad_round_count(capsys):
    b = _bench()
    with pytest.raises(SystemExit) as e:
        b.main(["--dry-run", "--rounds", "0"])
    assert e.value.code == 2 and "--rounds" in capsys.readouterr().err


def _stage_outputs(tmp_path, *, resumed_steps=150, bench_ok=True, device="cuda", status="pass"):
    rows = [
        f"env\t{status}\t0\t3",
        "cuda-tests\tskip\t0\t0\tpytest is not installed",
        "bench\tpass\t0\t60",
        "train\tpass\t0\t20",
        "train-resume\tpass\t0\t10",
        "predict\tpass\t0\t5",
    ]
    (tmp_path / "stages.tsv").write_text("\n".join(rows) + "\n")
    first = {"steps": 120, "checkpoint": "ckpt/step-120", "final_loss": 0.5}
    resumed = {"steps": resumed_steps, "resumed_from_step": 120, "final_loss": 0.4}
    (tmp_path / "train.txt").write_text("a log line\n" + json.dumps(first) + "\n")
    (tmp_path / "train-resume.txt").write_text("resumed\n" + json.dumps(resumed) + "\n")
    (tmp_path / "engine-bench.json").write_text(json.dumps({"within_target": bench_ok}))
    (tmp_path / "profile.json").write_text(json.dumps({"device": device}))
    (tmp_path / "predict.txt").write_text("table\n" + json.dumps([{"world_size": 8}]) + "\n")
    (tmp_path / "env.json").write_text(json.dumps({"torch": "2.11.0", "device_name": "H200"}))


def test_the_report_passes_a_good_run_and_keeps_every_figure(tmp_path):
    r = _script("gpu_check_report")
    _stage_outputs(tmp_path)
    assert r.main([str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "gpu-check.json").read_text())
    assert doc["ok"] and doc["failed"] == [] and all(doc["checks"].values())
    assert doc["stages"]["cuda-tests"] == {
        "status": "skip",
        "rc": 0,
        "seconds": 0,
        "note": "pytest is not installed",
    }
    assert doc["seconds"] == 98 and doc["environment"]["device_name"] == "H200"
    assert doc["train"]["resumed"]["steps"] == 150 and doc["predict"] == [{"world_size": 8}]


@pytest.mark.parametrize(
    ("change", "failed"),
    [
        ({"resumed_steps": 130}, ["resume_from_checkpoint"]),
        ({"bench_ok": False}, ["bench_within_target"]),
        ({"device": "cpu"}, ["predict_from_gpu_profile"]),
        ({"status": "timeout"}, ["env"]),
    ],
)
def test_the_report_fails_a_run_that_went_wrong(tmp_path, change, failed):
    r = _script("gpu_check_report")
    _stage_outputs(tmp_path, **change)
    assert r.main([str(tmp_path)]) == 1
    assert json.loads((tmp_path / "gpu-check.json").read_text())["failed"] == failed


def test_syncs_are_counted_from_the_sync_debug_warnings(monkeypatch):
    b = _bench()
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    with b.count_syncs(torch.device("cuda", 0)) as found:
        # what torch warns at each synchronizing call in "warn" mode, and a warning that is not one
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
        warnings.warn("something else", stacklevel=1)
    assert found == [2] and modes == ["warn", "default"]
    with b.count_syncs(torch.device("cpu")) as found:
        pass
    assert found == []  # a CPU has no device to wait for: nothing counted
