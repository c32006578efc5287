"""Convergence bench: W=1 with accumulation equals W=2, departures are flagged, JSON, flags, report files."""

import argparse
import contextlib
import io
import json
import math
import struct
import sys
import types

import pytest

from dpscale.cli import bench as commands
from dpscale.lab.bench import convergence
from dpscale.lab.bench.convergence import (
    SUMMARY_KEYS,
    ConvergenceConfig,
    ConvergenceResult,
    ConvergenceRun,
    compare_curves,
    verdict,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
STEPS = 6  # 384 samples of global batch 64: two rank start-ups per world size dominate the time


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    commands.add_convergence_arguments(parser)
    return parser.parse_args(argv)


def _run_cli(flags: list[str]) -> types.SimpleNamespace:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["/usr/bin/dpscale", "bench", "convergence", *flags])
        rc = commands.run_convergence(_parse(flags))
    return types.SimpleNamespace(rc=rc, stdout=out.getvalue())


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """One small real run (digits, W=1 with k=2 and W=2 with k=1), shared by the tests that read it."""
    base = tmp_path_factory.mktemp("reports")
    flags = ["--world-sizes", "1,2", "--samples", str(64 * STEPS), "--json", "--report-dir", str(base)]
    run = _run_cli(flags)
    (run.report_dir,) = base.iterdir()
    run.doc = json.loads((run.report_dir / "report.json").read_text())
    return run


@pytest.mark.slow
def test_json_line_has_one_documented_object_per_world_size(cli_run):
    assert cli_run.rc == 0
    summary = json.loads(cli_run.stdout.strip().splitlines()[-1])
    assert [list(s) for s in summary] == [SUMMARY_KEYS] * 2
    assert [(s["world_size"], s["accumulation_steps"]) for s in summary] == [(1, 2), (2, 1)]
    for s in summary:
        assert (s["workload"], s["global_batch"], s["steps"], s["samples"]) == ("digits", 64, STEPS, 384)
        assert math.isfinite(s["final_loss"]) and 0 <= s["test_accuracy"] <= 1
        assert s["within_tolerance"] is True
    assert cli_run.doc["results"]["reference_world_size"] == summary[0]["world_size"] == 1
    assert f"report: {cli_run.report_dir}" in cli_run.stdout


@pytest.mark.slow
def test_accumulation_on_one_rank_follows_the_two_rank_curve(cli_run):
    """Same samples per step, same init: W=1 k=2 and W=2 k=1 compute the same full-batch mean
    gradient, so only float summation order differs. 1e-5 relative is far above that rounding
    (about 1e-7 per step for float32, growing slowly over 6 steps) and far below any real bug."""
    one, two = cli_run.doc["results"]["runs"]
    assert one["samples_seen"] == two["samples_seen"] == [64 * (i + 1) for i in range(STEPS)]
    assert one["losses"][0] == pytest.approx(two["losses"][0], rel=1e-6)  # identical weights at step 1
    for a, b in zip(one["losses"], two["losses"], strict=True):
        assert b == pytest.approx(a, rel=1e-5)
    assert two["max_rel_gap"] <= 1e-5
    assert two["final_loss"] == pytest.approx(one["final_loss"], rel=1e-5)
    # the gap reported is W=2's curve against W=1's, as the report's own curves give it
    gap = compare_curves(one["losses"], two["losses"], tolerance=0.05)
    assert (two["max_gap"], two["max_rel_gap"]) == (gap.max_gap, gap.max_rel_gap)


def test_every_run_but_the_reference_is_compared_with_the_reference_curve(monkeypatch):
    """`run` with the ranks replaced by fixed curves (no process): each world size's gap is to the
    smallest world size's curve, so a run that departs from it is flagged and one that follows it
    is not, whatever the curve is compared with when it is the reference."""
    ref = _curve(STEPS * 4)
    curves = {1: ref, 2: [v * 1.01 for v in ref], 4: [v * 1.2 for v in ref]}

    def fake_ranks(fn, world_size, train_kwargs, **kwargs):
        lines = [
            json.dumps({"step": t + 1, "samples_seen": 64 * (t + 1), "loss": loss})
            for t, loss in enumerate(curves[world_size])
        ]
        with open(f"{train_kwargs['metrics_dir']}/metrics.jsonl", "w") as f:
            f.write("\n".join(lines) + "\n")
        keys = ("accumulation_steps", "micro_batch", "steps", "test_accuracy", "param_sha256")
        return [
            {k: 0 for k in keys} | {"samples_per_s": 1.0, "samples_seen": 64 * len(ref), "final_loss": 0.1}
        ]

    monkeypatch.setattr(convergence, "run_ranks", fake_ranks)
    config = ConvergenceConfig(world_sizes=[1, 2, 4], global_batch=64, samples=64 * len(ref), tolerance=0.05)
    result = convergence.run(config)
    assert [r.world_size for r in result.runs] == [1, 2, 4] and result.reference.world_size == 1
    for r in result.runs[1:]:
        expected = compare_curves(ref, curves[r.world_size], tolerance=0.05)
        assert (r.max_gap, r.max_rel_gap, r.within_tolerance) == (
            expected.max_gap,
            expected.max_rel_gap,
            expected.within_tolerance,
        )
    assert result.runs[1].max_rel_gap == pytest.approx(0.01) and result.runs[1].within_tolerance
    assert result.runs[2].max_rel_gap == pytest.approx(0.2) and not result.runs[2].within_tolerance


@pytest.mark.slow
def test_report_directory_holds_json_csv_png_and_markdown(cli_run):
    d = cli_run.report_dir
    assert d.name.endswith("-convergence")
    assert {"report.md", "report.json", "convergence.csv", "convergence.png"} <= {f.name for f in d.iterdir()}
    assert cli_run.doc["command"] == "convergence"
    results = cli_run.doc["results"]
    assert set(results) == {
        "config",
        "reference_world_size",
        "smoothing_window_steps",
        "compared_from_step",
        "runs",
    }
    assert results["config"] == {
        "workload": "digits",
        "world_sizes": [1, 2],
        "global_batch": 64,
        "samples": 384,
        "seed": 0,
        "tolerance": 0.05,
    }
    assert ConvergenceResult.from_dict(results).to_dict() == results
    csv_lines = (d / "convergence.csv").read_text().splitlines()
    assert csv_lines[0] == "world_size,accumulation_steps,step,samples_seen,loss,smoothed_loss"
    assert len(csv_lines) == 1 + 2 * STEPS
    head = (d / "convergence.png").read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR"
    width, height = struct.unpack(">II", head[16:24])
    assert 600 <= width <= 2000 and 400 <= height <= 1500
    md = (d / "report.md").read_text()
    assert "second half of training" in md and "tolerance of 5%" in md
    assert "| 2 | 1 | 32 | 6 | 384 |" in md and "| ok |" in md
    assert "![training loss vs samples seen per world size](convergence.png)" in md


# ---- gaps and verdicts on synthetic curves (no training) ----------------------------------------


def _curve(steps: int = 40) -> list[float]:
    return [2.0 / (1 + 0.2 * t) for t in range(steps)]


def test_a_curve_that_departs_in_the_second_half_is_flagged():
    ref = _curve()
    high = [v * (1.10 if t >= 10 else 1.0) for t, v in enumerate(ref)]  # 10% high from step 10 on
    gap = compare_curves(ref, high, tolerance=0.05)
    assert not gap.within_tolerance
    assert gap.max_rel_gap == pytest.approx(0.10, rel=1e-9)
    # the absolute gap is largest where the loss is: at the first compared step (index 20)
    window = convergence.smoothing_window(40)
    assert window == 5
    assert gap.max_gap == pytest.approx(0.1 * convergence.smooth(ref, window)[20], rel=1e-9)
    close = compare_curves(ref, [v * 1.01 for v in ref], tolerance=0.05)
    assert close.within_tolerance and close.max_rel_gap == pytest.approx(0.01, rel=1e-9)


def test_an_early_difference_that_closes_up_is_not_a_departure():
    ref = _curve()
    early = [v * (1.5 if t < 10 else 1.0) for t, v in enumerate(ref)]  # gone well before step 20
    gap = compare_curves(ref, early, tolerance=0.05)
    assert gap.within_tolerance and gap.max_rel_gap == 0


def test_a_non_finite_loss_departs_without_a_number():
    ref = _curve()
    gap = compare_curves(ref, ref[:30] + [None] * 10, tolerance=0.05)
    assert (gap.max_gap, gap.max_rel_gap, gap.within_tolerance) == (None, None, False)
    with pytest.raises(ValueError, match="same, non-zero number of steps"):
        compare_curves(ref, ref[:-1], tolerance=0.05)


def _hand_built(tolerance: float = 0.05) -> ConvergenceResult:
    config = ConvergenceConfig(world_sizes=[1, 2, 4], global_batch=64, samples=64 * 40, tolerance=tolerance)
    ref = _curve()
    curves = {1: ref, 2: [v * 1.001 for v in ref], 4: [v * 1.2 for v in ref]}
    runs = []
    for w, losses in curves.items():
        gap = compare_curves(ref, losses, tolerance)
        runs.append(
            ConvergenceRun(
                world_size=w,
                accumulation_steps=4 // w,
                micro_batch=16,
                steps=40,
                samples=64 * 40,
                final_loss=losses[-1],
                test_accuracy=0.9,
                param_sha256="0" * 64,
                wall_s=1.0,
                samples_per_s=1000.0,
                samples_seen=[64 * (t + 1) for t in range(40)],
                losses=losses,
                max_gap=gap.max_gap,
                max_rel_gap=gap.max_rel_gap,
                within_tolerance=gap.within_tolerance,
            )
        )
    return ConvergenceResult(config, runs)


@pytest.mark.slow
def test_a_departing_run_gets_its_verdict_and_a_failing_exit_code(tmp_path, monkeypatch):
    result = _hand_built()
    assert [verdict(r, 1) for r in result.runs] == ["reference", "ok", "DEPARTS beyond tolerance"]
    monkeypatch.setattr(convergence, "run", lambda config: result)
    run = _run_cli(["--world-sizes", "1,2,4", "--samples", "2560", "--json", "--report-dir", str(tmp_path)])
    assert run.rc == 1
    assert "DEPARTS beyond tolerance" in run.stdout and "Largest gap: world size 4 vs 1" in run.stdout
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert [s["within_tolerance"] for s in summary] == [True, True, False]
    assert summary[2]["max_rel_gap"] == pytest.approx(0.2)
    (d,) = tmp_path.iterdir()
    assert "| DEPARTS beyond tolerance |" in (d / "report.md").read_text()


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--workload", "nope"], "--workload"),
        (["--world-sizes", "0"], "--nproc"),
        (["--world-sizes", "1,1"], "--nproc"),
        (["--world-sizes", "2,3"], "--nproc"),
        (["--world-sizes", "1,2", "--global-batch", "63"], "--global-batch"),
        (["--samples", "100"], "--samples"),
        (["--samples", "640", "--seed", "-1"], "--seed"),
        (["--samples", "640", "--tolerance", "0"], "--tolerance"),
        (["--samples", "640", "--tolerance", "nan"], "--tolerance"),
    ],
)
def test_bad_flags_raise_one_line_value_errors_naming_the_flag(argv, flag):
    with pytest.raises(ValueError) as err:
        commands.convergence_config(_parse(argv))
    assert str(err.value).startswith(flag + ":") and "\n" not in str(err.value)


def test_uneven_world_sizes_are_told_which_to_use():
    told = r"3 does not divide the largest world size 4.*divisors of 4 \(1,2,4\)"
    with pytest.raises(ValueError, match=told):
        ConvergenceConfig(world_sizes=[1, 3, 4], samples=640)


def test_defaults_train_five_epochs_of_the_workloads_batch():
    config = ConvergenceConfig()
    assert (config.global_batch, config.samples, config.steps) == (64, 5 * 1438, 5 * 1438 // 64)
    assert [config.accumulation_steps(w) for w in config.world_sizes] == [2, 1]
