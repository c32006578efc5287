"""Weak-scaling convergence bench: targets, LR rules, ratios per N, AdaScale's gain, report files."""

import argparse
import contextlib
import dataclasses
import io
import json
import math
import sys
import types
from pathlib import Path

import pytest

from dpscale.cli import bench as bench_cli
from dpscale.lab.bench import compare, rerender, study, weak, weak_report
from dpscale.lab.bench import report as report_module
from dpscale.lab.bench.report import ReportDir
from dpscale.lab.bench.weak import SUMMARY_KEYS, WeakConfig, WeakResult, WeakRun
from dpscale.train.adaptive.adascale import AdaScaleGain, adascale_gain


def _parse(argv):
    parser = argparse.ArgumentParser()
    bench_cli.add_convergence_arguments(parser)
    return parser.parse_args(argv)


def _run_cli(flags):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["/usr/bin/dpscale", "bench", "convergence", *flags])
        rc = bench_cli.run_convergence(_parse(flags))
    return types.SimpleNamespace(rc=rc, stdout=out.getvalue())


# ---- AdaScale's gain ------------------------------------------------------------------------------


def test_adascale_gain_goes_from_one_to_the_scale_as_the_noise_grows():
    assert adascale_gain(None, base_batch=64, scale=4) == 1.0  # nothing measured yet
    assert adascale_gain(-5.0, base_batch=64, scale=4) == 1.0  # a |G|^2 estimate still negative
    assert adascale_gain(1e-6, base_batch=64, scale=4) == pytest.approx(1.0, abs=1e-6)  # no noise
    assert adascale_gain(1e12, base_batch=64, scale=4) == pytest.approx(4.0, rel=1e-6)  # all noise
    # B_simple = b: sigma^2 = |G|^2, so r = 2 / (1/4 + 1) = 1.6
    assert adascale_gain(64.0, base_batch=64, scale=4) == pytest.approx(1.6)
    assert adascale_gain(64.0, base_batch=64, scale=1) == 1.0
    with pytest.raises(ValueError, match="scale >= 1"):
        adascale_gain(1.0, base_batch=64, scale=0.5)


def test_adascale_callback_multiplies_this_steps_rate_only():
    groups = [{"lr": 0.1}, {"lr": 0.01}]
    trainer = types.SimpleNamespace(
        state=types.SimpleNamespace(global_batch=256),
        noise_scale=types.SimpleNamespace(b_simple=64.0),
        optimizer=types.SimpleNamespace(param_groups=groups),
    )
    cb = AdaScaleGain(base_batch=64)
    cb.after_reduce(trainer, [])
    assert [g["lr"] for g in groups] == pytest.approx([0.16, 0.016])
    assert cb.gains == [pytest.approx(1.6)]


# ---- config ---------------------------------------------------------------------------------------


def test_lr_rules_and_evaluation_points():
    c = WeakConfig(world_sizes=[1, 2, 3], target_loss=0.3, lr=0.1, lr_rule="sqrt")
    assert [c.global_batch(n) for n in (1, 2, 3)] == [64, 128, 192]
    assert c.lr_at(4) == pytest.approx(0.2)
    assert c.eval_every_samples % 384 == 0  # every N is checked at the same sample counts
    assert WeakConfig(target_loss=0.3, lr=0.1, lr_rule="linear").lr_at(4) == pytest.approx(0.4)
    assert WeakConfig(target_loss=0.3, lr=0.1, lr_rule="none").lr_at(4) == 0.1
    assert WeakConfig(target_loss=0.3, lr=0.1, lr_rule="adascale").lr_at(4) == 0.1  # gain per step
    assert WeakConfig(target_metric="accuracy=0.9").target == ("accuracy", 0.9)


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--mode", "weak"], "--target-loss / --target-metric"),
        (["--mode", "weak", "--target-loss", "1", "--target-metric", "accuracy=0.9"], "--target-loss"),
        (["--mode", "weak", "--target-metric", "accuracy"], "--target-metric"),
        (["--mode", "weak", "--target-metric", "bleu=3"], "--target-metric"),
        (["--mode", "weak", "--target-loss", "1", "--world-sizes", "2,4"], "--nproc"),
        (["--mode", "weak", "--target-loss", "1", "--lr-rule", "cubic"], "--lr-rule"),
        (["--mode", "weak", "--target-loss", "1", "--lr-rule", "adascale", "--engine", "torch"], "--lr-rule"),
        (
            ["--mode", "weak", "--target-loss", "1", "--batch-per-worker", "1000", "--world-sizes", "1,2"],
            "--batch",
        ),
        (["--mode", "weak", "--target-loss", "1", "--tolerance", "0.1"], "--tolerance"),
    ],
)
def test_bad_weak_flags_are_one_line_errors_naming_the_flag(argv, flag):
    with pytest.raises(ValueError) as err:
        bench_cli.weak_config(_parse(argv))
    assert str(err.value).startswith(flag) and "\n" not in str(err.value)


def test_weak_flags_are_refused_in_same_batch_mode():
    with pytest.raises(ValueError, match=r"^--lr-rule: not a flag of --mode same-batch"):
        bench_cli.convergence_config(_parse(["--lr-rule", "sqrt", "--samples", "640"]))


# ---- results and the report (hand-built, no training) ---------------------------------------------


# a real run's system block, so that no test here starts `uname` (the fast tier starts no process)
SYSTEM = json.loads((Path(__file__).parent / "data" / "study-quick-v0.json").read_text())["system"]


def _report_dir(path):
    path.mkdir(parents=True)
    return ReportDir(path=path, command="convergence-weak", argv=["dpscale", "bench"], system=SYSTEM)


def _run(n, samples, step_ms, reached=True):
    g = 64 * n
    steps = samples // g if reached else None
    checks = [
        {"step": s, "samples": s * g, "value": 1.0 / s, "gns": 50.0} for s in range(1, 1 + (steps or 5))
    ]
    return WeakRun(
        world_size=n,
        global_batch=g,
        lr=0.1 * n,
        reached=reached,
        steps_to_target=steps,
        samples_to_target=samples if reached else None,
        step_ms=step_ms,
        time_to_target_s=steps * step_ms / 1e3 if reached else None,
        samples_per_s=g / (step_ms / 1e3),
        gns_at_target=50.0,
        checks=checks,
        steps_run=steps or 5,
    )


def _hand_built():
    config = WeakConfig(world_sizes=[1, 2, 4], target_loss=0.2)
    return WeakResult(config, [_run(1, 1280, 2.0), _run(2, 1536, 2.5), _run(4, 0, 3.0, reached=False)])


def test_ratios_per_n_are_measured_from_that_n_run():
    result = _hand_built()
    q = result.ratios(result.runs[1])
    assert q["statistical_efficiency"] == pytest.approx(1280 / 1536)
    assert q["throughput_speedup"] == pytest.approx(2 * 2.0 / 2.5)
    # time-to-target speed-up is their product: T(1) / T(2)
    assert q["time_to_target_speedup"] == pytest.approx(q["statistical_efficiency"] * q["throughput_speedup"])
    missed = result.ratios(result.runs[2])
    assert missed["statistical_efficiency"] is None and missed["time_to_target_speedup"] is None
    assert [list(s) for s in result.summary()] == [SUMMARY_KEYS] * 3


def test_report_says_not_reached_and_rerenders_from_json(tmp_path):
    result = _hand_built()
    report = _report_dir(tmp_path / "weak")
    weak_report.write_report(result, report)
    files = {f.name for f in report.path.iterdir()}
    assert {"report.md", "report.json", "weak.csv", "weak_curves.png", "weak_speedup.png"} <= files
    md = (report.path / "report.md").read_text()
    assert "| 4 | 256 | 0.4 | not reached | not reached |" in md
    assert "N=2: throughput x1.60, statistical efficiency 0.83, so time to target x1.33." in md
    assert "N=4: not reached" in weak_report.findings_text(result)
    doc = json.loads((report.path / "report.json").read_text())
    assert WeakResult.from_dict(doc["results"]).to_dict() == doc["results"]
    (report.path / "report.md").unlink()
    rerender.rerender(report.path)
    assert (report.path / "report.md").read_text() == md


def test_two_weak_reports_compare_per_n(tmp_path):
    dirs = []
    for name, slow in (("a", 1.0), ("b", 2.0)):
        result = _hand_built()
        result.runs[1] = _run(2, 1536, 2.5 * slow)
        report = _report_dir(tmp_path / name)
        weak_report.write_report(result, report)
        dirs.append(report.path)
    c = compare.compare(dirs)
    assert c.key_columns == ["world_size"]
    n2 = next(r for r in c.rows if r["key"] == {"world_size": 2})
    assert n2["ratios"]["time_to_target_s"] == [pytest.approx(2.0)]
    assert n2["ratios"]["statistical_efficiency"] == [pytest.approx(1.0)]


# ---- trust checks (bench/trust.py) ----------------------------------------------------------------


def _timed(run, p10, p90):
    return dataclasses.replace(run, step_ms_p10=p10, step_ms_p90=p90)


def test_weak_trust_checks_name_each_n_with_a_wide_spread_or_an_impossible_time():
    result = _hand_built()
    assert weak_report.warnings(result) == []  # no p10/p90 (an older report): nothing to judge
    result.runs[:2] = [_timed(result.runs[0], 1.9, 2.1), _timed(result.runs[1], 2.0, 2.875)]
    (spread,) = weak_report.warnings(result)  # N=1 10%: fine; N=2 35%: the load moved
    assert "times spread (p10-p90) above 20% of the median (digits dpscale N=2 35%)" in spread
    assert result.runs[1].spread == pytest.approx(0.35)
    # N=2 more than twice as fast as N=1, with the same threads per worker: N=1 was slowed
    result.runs[1] = _timed(_run(2, 1536, 0.8), 0.79, 0.81)
    (faster,) = weak_report.warnings(result)
    assert faster.startswith("throughput speed-up above N (digits dpscale N=2 x5.00)")
    result.runs[1] = _run(2, 1536, -0.5)  # e.g. an evaluation subtracted from a step it was not in
    (broken,) = weak_report.warnings(result)  # the speed-up check divides by it: not repeated
    assert broken.startswith("step times that are not positive (digits dpscale N=2 -0.5 ms)")


def test_weak_warnings_head_the_report_survive_rerender_and_reach_the_terminal(tmp_path, capsys, monkeypatch):
    result = _hand_built()
    result.runs[:2] = [_timed(result.runs[0], 1.9, 2.1), _timed(result.runs[1], 2.0, 2.875)]
    report = _report_dir(tmp_path / "weak")
    weak_report.write_report(result, report)
    md = (report.path / "report.md").read_text()
    head = md[md.index("## Warnings") : md.index("## Method")]
    assert "- **Warning:** times spread (p10-p90) above 20% of the median (digits dpscale N=2 35%)" in head
    assert "| 2 | 128 | 0.2 | 12 | 1536 | 2.50 | 35% |" in md  # the spread is in its own row
    doc = json.loads((report.path / "report.json").read_text())
    assert doc["results"]["runs"][1]["step_ms_p90"] == 2.875
    (report.path / "report.md").unlink()
    rerender.rerender(report.path)
    assert (report.path / "report.md").read_text() == md
    # the command prints them on stderr
    monkeypatch.setattr(weak, "run", lambda config: result)
    monkeypatch.setattr(report_module, "collect_system_info", lambda: SYSTEM)  # no uname: fast tier
    run = _run_cli(["--mode", "weak", "--target-loss", "0.2", "--report-dir", str(tmp_path / "cli")])
    assert run.rc == 0
    assert "warning: times spread (p10-p90) above 20%" in capsys.readouterr().err
    # and a study with this weak run says so in its own warnings
    v0 = json.loads((Path(__file__).parent / "data" / "study-quick-v0.json").read_text())["results"]
    with_weak = dataclasses.replace(study.StudyResult.from_dict(v0), weak=[result])
    assert any("(digits dpscale N=2 35%)" in w for w in with_weak.warnings())


# ---- a real run ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_weak_run_stops_at_the_target_and_reports_each_n(tmp_path):
    flags = ["--mode", "weak", "--target-metric", "accuracy=0.8", "--world-sizes", "1,2"]
    flags += ["--lr-rule", "adascale", "--json", "--report-dir", str(tmp_path)]
    run = _run_cli(flags)
    assert run.rc == 0, run.stdout
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert [s["world_size"] for s in summary] == [1, 2] and [s["global_batch"] for s in summary] == [64, 128]
    (d,) = tmp_path.iterdir()
    runs = json.loads((d / "report.json").read_text())["results"]["runs"]
    for s, r in zip(summary, runs, strict=True):
        assert s["reached"] and s["samples_to_target"] == s["steps_to_target"] * s["global_batch"]
        assert r["steps_run"] == s["steps_to_target"]  # the run ended at the check that met the target
        assert r["checks"][-1]["value"] >= 0.8 > max(c["value"] for c in r["checks"][:-1])
        assert s["time_to_target_s"] == pytest.approx(s["steps_to_target"] * s["step_ms"] / 1e3)
        assert 0 < r["step_ms_p10"] <= r["step_ms"] <= r["step_ms_p90"]  # kept for the trust checks
    assert summary[0]["statistical_efficiency"] == 1.0
    assert summary[1]["statistical_efficiency"] == pytest.approx(
        summary[0]["samples_to_target"] / summary[1]["samples_to_target"]
    )
    assert math.isfinite(summary[1]["gns_at_target"])  # N=2 measures the noise scale (AdaScale uses it)
    assert "Convergence bench, weak scaling" in (d / "report.md").read_text()
