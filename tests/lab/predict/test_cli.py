"""`dpscale predict` / `dpscale profile` through their argument parsers: JSON line, report, bad input."""

import argparse
import contextlib
import io
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from dpscale.cli import predict as cli
from dpscale.lab.predict.compression_cost import CompressionCost
from dpscale.lab.predict.model import CASTS_LABEL, JSON_KEYS
from dpscale.lab.predict.profile import ModelProfile

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
EXPLICIT = ["--params", "25.6e6", "--step-compute-ms", "120", "--per-worker-batch", "32"]


def _run(command: str, argv: list[str], monkeypatch) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    getattr(cli, f"add_{command}_arguments")(parser)
    args = parser.parse_args(argv)
    out = io.StringIO()
    monkeypatch.setattr(sys, "argv", ["/usr/bin/dpscale", command, *argv])
    with contextlib.redirect_stdout(out):
        rc = getattr(cli, f"run_{command}_from_args")(args)
    return rc, out.getvalue()


@pytest.mark.slow
def test_json_is_the_last_line_with_the_documented_keys_and_a_report_is_written(tmp_path, monkeypatch):
    argv = [*EXPLICIT, "--preset", "dgx-a100", "--json", "--report-dir", str(tmp_path)]
    rc, out = _run("predict", argv, monkeypatch)
    assert rc == 0
    rows = json.loads(out.strip().splitlines()[-1])
    assert [r["world_size"] for r in rows] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    assert all(tuple(r) == JSON_KEYS for r in rows)
    assert rows[0]["efficiency"] == 1.0 and rows[-1]["nodes"] == 128
    assert all(isinstance(r["bottleneck"], str) and r["bottleneck"] for r in rows)
    (report,) = tmp_path.iterdir()
    assert report.name.endswith("-predict")
    assert {p.name for p in report.iterdir()} == {"report.json", "report.md", "predict.csv", "predict.png"}
    assert (report / "predict.png").read_bytes().startswith(PNG_SIGNATURE)
    doc = json.loads((report / "report.json").read_text())
    assert doc["command"] == "predict" and len(doc["results"]["predictions"]) == len(rows)
    assert "NVIDIA DGX A100" in (report / "report.md").read_text()
    # what each term costs, per world size; the bottleneck is the largest (unless compute-bound)
    last = doc["results"]["predictions"][-1]
    assert last["losses_ms"] and "Where the step goes" in (report / "report.md").read_text()
    if last["bottleneck"] != "compute":
        assert last["bottleneck"] == max(last["losses_ms"], key=last["losses_ms"].get)


@pytest.mark.slow
def test_nodes_alone_is_one_world_size_and_flags_override_the_preset(tmp_path, monkeypatch):
    argv = [*EXPLICIT, "--preset", "pcie3-x16+eth-25g", "--workers-per-node", "4", "--nodes", "32"]
    argv += ["--inter-bw-Gbps", "100", "--algorithm", "ring", "--json", "--report-dir", str(tmp_path)]
    rc, out = _run("predict", argv, monkeypatch)
    (row,) = json.loads(out.strip().splitlines()[-1])
    assert (row["world_size"], row["nodes"]) == (128, 32)
    assert "inter-node 100 Gbit/s" in out


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--inter-bw-Gbps", "-1"], "--inter-bw-Gbps"),
        (["--intra-lat-us", "-3"], "--intra-lat-us"),
        (["--algorithm", "star"], "--algorithm"),
        (["--world-sizes", "1,x"], "--world-sizes"),
        (["--preset", "dgx-a100", "--world-sizes", "12"], "--world-sizes"),
        (["--preset", "warp-drive"], "--preset"),
        (["--nodes", "2", "--world-sizes", "2"], "--nodes"),
        (["--compression", "0"], "--compression"),
        (["--transport", "shm"], "--transport"),
        (["--compute-cv", "2"], "--compute-cv"),
        (["--node-cv", "-0.1"], "--node-cv"),
        (["--compute-cv", "0.1", "--compute-tail", "1.2"], "--compute-tail"),
        (["--compute-tail", "0.5"], "--compute-tail"),
        (["--oversubscription", "0.5"], "--oversubscription"),
        (["--nodes-per-switch", "0"], "--nodes-per-switch"),
        (["--congestion-per-doubling", "1.5"], "--congestion-per-doubling"),
        (["--interference", "2"], "--interference"),
        (["--input-samples-per-s", "0"], "--input-samples-per-s"),
        (["--inter-efficiency", "1.5"], "--inter-efficiency"),
        (["--intra-efficiency", "0"], "--intra-efficiency"),
        (["--model", "mlp"], "--model"),  # together with the explicit numbers
    ],
)
def test_bad_input_names_the_flag(argv, flag, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=flag):
        _run("predict", [*EXPLICIT, *argv, "--report-dir", str(tmp_path)], monkeypatch)
    assert not any(tmp_path.iterdir())  # nothing written before the error


def test_explicit_numbers_need_both(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="--params"):
        _run("predict", ["--params", "1e6", "--report-dir", str(tmp_path)], monkeypatch)


@pytest.mark.slow
def test_profile_command_writes_a_profile_that_predict_reads(tmp_path, monkeypatch):
    path = tmp_path / "digits.json"
    argv = ["--model", "digits", "--per-worker-batch", "16", "--steps", "3", "--warmup", "1"]
    rc, out = _run("profile", [*argv, "--out", str(path), "--json"], monkeypatch)
    assert rc == 0 and "bucket 0" in out
    assert ModelProfile.from_dict(json.loads(out.strip().splitlines()[-1])) == ModelProfile.load(path)
    argv = ["--profile", str(path), "--preset", "cpu-shm", "--world-sizes", "1,2", "--json"]
    rc, out = _run("predict", [*argv, "--report-dir", str(tmp_path / "r")], monkeypatch)
    assert [r["world_size"] for r in json.loads(out.strip().splitlines()[-1])] == [1, 2]


def test_help_shows_worked_examples(capsys):
    parser = argparse.ArgumentParser()
    cli.add_predict_arguments(parser)
    help_text = parser.format_help()
    assert "worked examples:" in help_text and "--preset dgx-h100" in help_text
    assert "--no-stragglers" in help_text and "--preset pcie3-x16+roce-25g" in help_text
    assert "--input-samples-per-s 12000" in help_text and "--no-input-pipeline" in help_text
    # every continued example line is shown as two lines, as a shell takes it
    assert "--preset dgx-a100 \\\n      --world-sizes 1,8" in help_text


def test_the_input_pipeline_flags_reach_the_terms():
    parser = argparse.ArgumentParser()
    cli.add_predict_arguments(parser)
    opts = cli.PredictOptions(**cli.dataclass_kwargs(parser.parse_args([]), cli.PredictOptions))
    assert cli.scale_terms(opts).input_samples_per_s is None and cli.scale_terms(opts).input_pipeline
    opts = replace(opts, input_samples_per_s=9000.0, no_input_pipeline=True)
    terms = cli.scale_terms(opts)
    assert terms.input_samples_per_s == 9000.0 and not terms.input_pipeline


@pytest.mark.slow
def test_each_term_switches_off_and_the_bottleneck_names_the_dominant(tmp_path, monkeypatch):
    # VGG-16-like on 4-GPU PCIe servers over 25 GbE RoCE at 512 GPUs: bandwidth-bound
    base = ["--params", "138.4e6", "--step-compute-ms", "416", "--per-worker-batch", "64"]
    base += ["--preset", "pcie3-x16+roce-25g", "--workers-per-node", "4", "--world-sizes", "512"]
    base += ["--algorithm", "ring", "--compute-cv", "0.03", "--json"]

    def efficiency(*flags: str) -> tuple[float, str]:
        rc, out = _run("predict", [*base, *flags, "--report-dir", str(tmp_path)], monkeypatch)
        (row,) = json.loads(out.strip().splitlines()[-1])
        return row["efficiency"], row["bottleneck"]

    full, bottleneck = efficiency()
    assert bottleneck == "inter-node bandwidth"
    for flag in ("--no-stragglers", "--no-achieved-bandwidth"):
        assert efficiency(flag)[0] > full, flag
    # the achieved fraction is calibratable: a measured 50% of nominal is slower than the preset's 95%
    assert efficiency("--inter-efficiency", "0.5")[0] < full
    assert efficiency("--inter-efficiency", "1")[0] == efficiency("--no-achieved-bandwidth")[0]
    # the node term: more noise per node costs at 128 nodes, and --no-stragglers takes it away too
    assert efficiency("--node-cv", "0.05")[0] < full
    assert efficiency("--node-cv", "0.05", "--no-stragglers")[0] == efficiency("--no-stragglers")[0]
    congested, _ = efficiency("--oversubscription", "2")
    assert congested < full and efficiency("--oversubscription", "2", "--no-congestion")[0] == full
    # a host that prepares 100 samples/s for a node of 4 workers asking 4 x 64 per step: it dominates
    starved, named = efficiency("--input-samples-per-s", "100")
    assert starved < full and named.startswith("input pipeline")
    assert efficiency("--input-samples-per-s", "100", "--no-input-pipeline")[0] == full
    # compute-bound: with a large step-to-step variation the stragglers are the dominant loss
    cpu_bound = ["--params", "1e6", "--step-compute-ms", "400", "--preset", "dgx-h100"]
    cpu_bound += ["--world-sizes", "1024", "--compute-cv", "0.05", "--json", "--report-dir", str(tmp_path)]
    rc, out = _run("predict", cpu_bound, monkeypatch)
    (row,) = json.loads(out.strip().splitlines()[-1])
    assert row["bottleneck"].startswith("stragglers")


@pytest.mark.slow
def test_a_cpu_profile_on_a_gpu_preset_warns(tmp_path, monkeypatch, capsys):
    prof = replace(cli.profiles.explicit(
        params=1000, bytes_per_param=4, step_compute_ms=5, backward_fraction=0.5, per_worker_batch=8
    ), device="cpu")  # fmt: skip
    path = prof.save(tmp_path / "cpu.json")
    argv = ["--profile", str(path), "--world-sizes", "1,8", "--report-dir", str(tmp_path / "r")]
    _run("predict", [*argv, "--preset", "dgx-h100"], monkeypatch)
    assert "measured on a CPU" in capsys.readouterr().err
    _run("predict", [*argv, "--preset", "cpu-shm", "--workers-per-node", "8"], monkeypatch)
    assert "measured on a CPU" not in capsys.readouterr().err


def test_a_malformed_calibration_file_is_one_line_naming_it_before_any_work(tmp_path, monkeypatch):
    bad = tmp_path / "bad.txt"
    bad.write_text("# nThread 1 nGpus 8\n  1024  256  float  sum  -1  12.0\n")
    argv = [
        *EXPLICIT,
        "--preset",
        "dgx-h100",
        "--calibrate-from",
        str(bad),
        "--report-dir",
        str(tmp_path / "r"),
    ]
    with pytest.raises(ValueError, match=f"--calibrate-from: {bad} line 2: ") as e:
        _run("predict", argv, monkeypatch)
    assert "\n" not in str(e.value) and not (tmp_path / "r").exists()


@pytest.mark.slow
def test_calibrate_from_nccl_tests_and_no_nvls(tmp_path, monkeypatch):
    table = Path(__file__).resolve().parent / "data" / "nccl_tests" / "h100-16gpu-2node.txt"
    argv = [*EXPLICIT, "--preset", "dgx-h100", "--world-sizes", "8,16,64", "--json"]
    rc, out = _run(
        "predict", [*argv, "--calibrate-from", str(table), "--report-dir", str(tmp_path)], monkeypatch
    )
    assert rc == 0 and "calibrated from measured all-reduce times" in out
    rows = json.loads(out.strip().splitlines()[-1])
    assert [r["world_size"] for r in rows] == [8, 16, 64]
    rc, out = _run("predict", [*argv, "--no-nvls", "--report-dir", str(tmp_path)], monkeypatch)
    assert rc == 0 and "NVLink SHARP" not in out.split("cluster ", 1)[1].splitlines()[0]


@pytest.mark.slow
def test_from_scale_predicts_larger_n_from_a_measured_run(tmp_path, monkeypatch):
    prof = ModelProfile.from_dict(
        {"model": "job", "source": "measured", "per_worker_batch": 32, "forward_ms": 30.0,
         "backward_ms": 60.0, "optimizer_ms": 10.0, "param_count": 5_000_000, "param_bytes": 20_000_000}
    )  # fmt: skip
    points = [{"engine": "dpscale", "world_size": n, "step_ms": ms} for n, ms in ((1, 100.0), (2, 130.0))]
    report = tmp_path / "scale.json"
    report.write_text(json.dumps({"results": {"config": {}, "points": points, "profile": prof.to_dict()}}))
    argv = ["--from-scale", str(report), "--preset", "cpu-shm", "--world-sizes", "1,2,4,8", "--json"]
    rc, out = _run("predict", [*argv, "--report-dir", str(tmp_path / "r")], monkeypatch)
    rows = json.loads(out.strip().splitlines()[-1])
    assert (
        rc == 0
        and "fitted to the measured steps" in (next((tmp_path / "r").iterdir()) / "report.md").read_text()
    )
    assert [r["world_size"] for r in rows] == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="--model: --from-scale measures the step"):
        _run("predict", [*argv, "--model", "mlp", "--report-dir", str(tmp_path / "r2")], monkeypatch)


@pytest.mark.slow
def test_compression_on_a_cpu_preset_counts_this_hosts_casts_and_a_gpu_preset_not(tmp_path, monkeypatch):
    rate = dict.fromkeys(("cast_in", "divide", "stage", "cast_out", "add16", "add32"), 0.1)
    casts = CompressionCost(**{f"{k}_ms_per_mb": v for k, v in rate.items()})
    measured = []
    monkeypatch.setattr(
        cli.compression_cost, "measure", lambda threads, staged: measured.append(staged) or casts
    )
    for preset in ("cpu-shm", "dgx-a100"):
        argv = [
            *EXPLICIT,
            "--preset",
            preset,
            "--compression",
            "2",
            "--world-sizes",
            "2",
            "--report-dir",
            str(tmp_path / preset),
        ]
        (tmp_path / preset).mkdir()
        assert _run("predict", argv, monkeypatch)[0] == 0
    assert measured == [True]  # timed for the CPU preset only, shm staging counted
    (cpu_dir,) = (tmp_path / "cpu-shm").iterdir()
    (gpu_dir,) = (tmp_path / "dgx-a100").iterdir()
    cpu = json.loads((cpu_dir / "report.json").read_text())
    assert json.loads((gpu_dir / "report.json").read_text())["results"]["config"]["compression_cost"] is None
    (p,) = cpu["results"]["predictions"]
    assert p["losses_ms"][CASTS_LABEL] == pytest.approx(casts.extra_ms(25.6e6 * 4, 2))
