"""`dpscale scale`'s diagnosis (lab/bench/script_diagnosis.py): the script's checks across world
sizes, the causes ranked by cost with the fix and its predicted gain, and --try's reruns, from
canned rank records (the runs themselves: tests/launch/test_run_scale.py)."""

from dataclasses import asdict, replace

import pytest

from dpscale.cli.main import main
from dpscale.lab.bench import script_diagnosis
from dpscale.lab.bench.script_scaling_report import format_table
from dpscale.lab.predict.compression_cost import CompressionCost
from dpscale.launch.script_checks import ScriptFacts
from support.scale_records import measure, rank, step

ONE = {"forward_ms": 10.0, "backward_ms": 20.0, "optimizer_ms": 2.0}


def _big(r: dict, mb: int = 100) -> dict:
    return {**r, "param_count": mb * 250_000, "param_bytes": mb * 1_000_000}  # 100 MB of gradients


def _runs(
    exposed_ms: float, *, lr2: float = 0.1, per_rank_at_2: int = 16, transport: str = "shm", mb: int = 100
) -> dict:
    facts = {n: asdict(ScriptFacts(world_size=n, lrs=[0.1 if n == 1 else lr2] * 8)) for n in (1, 2)}
    one = [step(ONE, samples=16)] * 8
    two = [step({**ONE, "exposed_comm_ms": exposed_ms}, samples=per_rank_at_2)] * 8
    at_2 = [{**rank(two, r, 2, script=facts[2]), "transport": transport} for r in (0, 1)]
    return {1: [_big(rank(one, script=facts[1]), mb)], 2: [_big(r, mb) for r in at_2]}


def test_exposed_communication_is_ranked_with_the_gains_predict_expects(monkeypatch):
    result = measure(monkeypatch, _runs(exposed_ms=16.0, transport="gloo"), 8)
    (first, *_) = script_diagnosis.causes(result)
    assert first.what == "exposed communication" and first.point.world_size == 2
    assert first.ms == pytest.approx(16.0) and first.points == pytest.approx(100 * 16 / 48)
    for fix in ("fp16 compression predicted +", "accumulation 2 predicted +"):
        assert fix in first.fix
    # gloo reduces beside backward, and larger buckets start later: predicted to lose, so not
    # advised, with the reason
    assert "; not bucket_cap_mb 50: predicted -" in first.fix and "(--try bucket_cap_mb=50)" not in first.fix
    # shm reduces on backward's own thread: nothing overlaps, so there is no overlap to lose
    on_shm = script_diagnosis.causes(measure(monkeypatch, _runs(exposed_ms=16.0), 8))[0]
    assert "bucket_cap_mb 50 predicted +" in on_shm.fix
    # fp16 halves the bytes of 100 MB of gradients: predict expects a gain
    assert script_diagnosis.predicted_gain(result, first.point, script_diagnosis.parse_try("fp16")) > 0
    text = format_table(result)
    assert "1. N=2 (dpscale): exposed communication: 16.0 ms/step (33.3 points): try accumulation 2" in text


def test_a_learning_rate_left_unchanged_while_the_global_batch_grew_is_said(monkeypatch):
    (line,) = script_diagnosis.checks(measure(monkeypatch, _runs(exposed_ms=1.0), 8))
    assert line.startswith("learning rate unchanged (0.1 at the first optimizer step) at N=1 and N=2")
    assert "grew 2x (16 -> 32 samples per optimizer step)" in line
    # scaled with the batch, or the global batch kept: nothing to say
    assert not script_diagnosis.checks(measure(monkeypatch, _runs(exposed_ms=1.0, lr2=0.2), 8))
    assert not script_diagnosis.checks(measure(monkeypatch, _runs(exposed_ms=1.0, per_rank_at_2=8), 8))
    # pytorch/examples' imagenet main.py on CPU wraps nothing: each rank trained alone, no global batch
    alone = _runs(exposed_ms=1.0)
    alone[2] = [{**r, "ddp": False, "transport": "none"} for r in alone[2]]
    assert not script_diagnosis.checks(measure(monkeypatch, alone, 8))


def test_try_prints_predicted_next_to_measured(monkeypatch):
    runs = _runs(exposed_ms=16.0)
    halved = [step({**ONE, "exposed_comm_ms": 8.0}, samples=16)] * 8
    runs[("try", "fp16")] = [_big(rank(halved, 0, 2)), _big(rank(halved, 1, 2))]  # type: ignore[index]
    result = measure(monkeypatch, runs, 8, tries=["fp16"])
    (tried,) = result.tries
    assert tried.note == "fp16" and tried.efficiency == pytest.approx(32 / 40)
    lines = script_diagnosis.tries(result)
    assert lines[0] == "--try at N=2: efficiency without a fix 66.7% (measured)"
    assert (
        lines[1].startswith("  fp16 compression: predicted ") and "measured 80.0% (+13.3 points)" in lines[1]
    )


def test_the_accumulation_trial_is_predicted_as_what_it_runs_beside_real_accumulation(monkeypatch):
    # the trial drops the all-reduce of 1 step in 2 and keeps each step's work (the script's
    # optimizer still steps): 2 x 32 ms of compute + one 16 ms exposed reduction per 32 samples.
    # 50 MB of gradients: the ~16 ms predict expects them to take on shm
    runs = _runs(exposed_ms=16.0, mb=50)
    trial = [step({k: 2 * v for k, v in ONE.items()} | {"exposed_comm_ms": 16.0}, samples=32)] * 8
    runs[("try", "accumulation=2")] = [_big(rank(trial, r, 2), 50) for r in (0, 1)]  # type: ignore[index]
    result = measure(monkeypatch, runs, 8, tries=["accumulation=2"])
    assert result.tries[0].efficiency == pytest.approx(0.8)
    fix = script_diagnosis.parse_try("accumulation=2")
    at_2 = result.points[1]
    trial_gain = script_diagnosis.predicted_gain(result, at_2, fix, trial=True)
    real_gain = script_diagnosis.predicted_gain(result, at_2, fix)
    assert trial_gain == pytest.approx(13.3, abs=1.0)  # the +13.3 points the trial measures
    assert real_gain is not None and real_gain > trial_gain  # a larger batch amortizes per-step costs too
    (_, line) = script_diagnosis.tries(result)
    predicted = f"{at_2.efficiency + trial_gain / 100:.1%} ({trial_gain:+.1f} points)"
    assert line.startswith(f"  accumulation 2: predicted {predicted} for the trial (one all-reduce per 2")
    assert f"real accumulation {real_gain:+.1f} points), measured 80.0% (+13.3 points)" in line
    # the advice predicts real accumulation and says which part of it the trial shows
    (first, *_) = script_diagnosis.causes(result)
    assert (
        f"accumulation 2 predicted {real_gain:+.1f} points (its communication part {trial_gain:+.1f}: "
        "what --try accumulation=2 measures)" in first.fix
    )


def test_try_refuses_in_one_line_where_no_ddp_model_was_built(monkeypatch):
    alone = [step(ONE, samples=16)] * 8
    runs = {1: [rank(alone, ddp=False)], 2: [rank(alone, 0, 2, ddp=False), rank(alone, 1, 2, ddp=False)]}
    result = measure(monkeypatch, runs, 8, tries=["fp16"])
    assert not result.tries
    assert script_diagnosis.tries(result) == [
        "--try reran nothing: it built no DDP model, so there is no engine to change at N=2"
    ]


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--try", "fp32"], "--try: unknown fix 'fp32'"),
        (["--try", "bucket_cap_mb=0"], "--try: bucket_cap_mb must be a size in MiB"),
        (["--try", "accumulation=1"], "--try: accumulation must be an integer from 2"),
        (["--try", "fp16,,accumulation=2"], "--try: 'fp16,,accumulation=2' has an empty entry"),
        (["--try", "fp16,fp16"], "names a fix twice"),
        (["--try", "fp16", "--engines", "torch"], "--try: the fixes change dpscale's engine"),
    ],
)
def test_bad_try_values_exit_2_in_one_line_before_any_run(tmp_path, capsys, monkeypatch, flags, said):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('never run')\n")
    monkeypatch.chdir(tmp_path)
    assert main(["scale", "--nproc", "1,2", *flags, "--", str(script)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0]
    assert not (tmp_path / "reports").exists()


# rates as `compression_cost.measure` gave them on the 2-core dev host (ms per MiB of fp32 gradient)
HOST_CASTS = CompressionCost(
    cast_in_ms_per_mb=0.16,
    divide_ms_per_mb=0.04,
    stage_ms_per_mb=0.03,
    cast_out_ms_per_mb=0.03,
    add16_ms_per_mb=0.06,
    add32_ms_per_mb=0.06,
)


def test_fp16_is_not_advised_where_its_casts_cost_more_than_the_halved_transfer_saves(monkeypatch):
    # 100 MB of gradients on the shm transport: the casts (~0.2 ms/MiB, ~21 ms) outweigh the
    # ~14 ms halving the transfer saves, as the three real scripts measured (issue #31)
    result = measure(monkeypatch, _runs(exposed_ms=16.0), 8, casts=HOST_CASTS)
    assert result.compression_cost == HOST_CASTS.to_dict()
    assert type(result).from_dict(result.to_dict()).compression_cost == result.compression_cost  # re-renders
    (first, *_) = script_diagnosis.causes(result)
    fp16 = script_diagnosis.parse_try("fp16")
    gain = script_diagnosis.predicted_gain(result, first.point, fp16)
    assert gain is not None and gain < 0
    free = script_diagnosis.predicted_gain(measure(monkeypatch, _runs(exposed_ms=16.0), 8), first.point, fp16)
    assert free is not None and free > 0  # the same run with free casts: the gain the bytes give
    assert "(--try fp16)" not in first.fix and "try accumulation 2 predicted +" in first.fix
    assert (
        f"not fp16 compression: predicted {gain:+.1f} points, casting gradients to fp16 and back" in first.fix
    )
    # an older report (no measured rates) predicts as before: the halved bytes only
    old = replace(result, compression_cost=None)
    assert script_diagnosis.predicted_gain(old, first.point, fp16) == pytest.approx(free)
