"""metrics.jsonl: one line per step, also across a resume from an earlier checkpoint."""

import json

from dpscale.train.metrics import MetricsWriter, StepMetrics


def _metrics(step: int, loss: float) -> StepMetrics:
    return StepMetrics(
        step=step,
        samples_seen=64 * step,
        loss=loss,
        lr=0.1,
        grad_norm=1.0,
        step_ms=1.0,
        samples_per_s=64e3,
        comm_ms=None,
        exposed_comm_ms=None,
    )


def _steps(directory):
    lines = (directory / "metrics.jsonl").read_text().splitlines()
    return [(m["step"], m["loss"]) for m in map(json.loads, lines)]


def test_a_resume_from_an_earlier_step_drops_the_lines_it_runs_again(tmp_path):
    # the run logged 1..8 and was killed; its last checkpoint is step 5, so steps 6..8 run again
    first = MetricsWriter(str(tmp_path))
    for step in range(1, 9):
        first.write(_metrics(step, 1.0))
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "lo')  # the line the kill cut short
    again = MetricsWriter(str(tmp_path), resumed_from=5)
    for step in (6, 7):
        again.write(_metrics(step, 2.0))
    again.close()
    assert _steps(tmp_path) == [(s, 1.0) for s in range(1, 6)] + [(6, 2.0), (7, 2.0)]


def test_a_fresh_run_starts_the_file_over(tmp_path):
    for loss in (1.0, 2.0):
        w = MetricsWriter(str(tmp_path))
        w.write(_metrics(1, loss))
        w.close()
    assert _steps(tmp_path) == [(1, 2.0)]


def test_progress_none_hides_the_progress_lines_but_keeps_the_summary(capsys):
    """Issue #34: `--progress none` hid the run's summary too; it hides only the per-step progress."""
    from dpscale.cli.main import main

    assert main(["train", "--workload", "synthetic", "--max-steps", "4", "--progress", "none"]) == 0
    err = capsys.readouterr().err
    assert "workers x micro-batch x accumulation" in err  # the summary table
    assert "step 4/4" not in err  # no progress line
