"""Each rank's phases, the steps merged into optimizer steps, and the straggler named from them."""

import pytest

from dpscale.engine.telemetry import PHASES, StepMarks
from dpscale.lab.bench import script_phases
from dpscale.lab.bench.script_phases import RANK_PHASES


def _step(**phases: float) -> dict:
    full = dict.fromkeys(PHASES, 0.0) | phases
    return {"step_ms": sum(full.values()), "phases": full, "optimizer_steps": 1}


def test_marks_split_a_step_into_phases_that_add_up_to_it():
    # 3 micro-steps from 0 to 0.030 s, the synced forward from 0.030, backward 0.040 to 0.070,
    # the optimizer to 0.075, the next step's first forward at 0.080; 10 ms of backward waited on comm
    marks = StepMarks(last_forward=0.030, backward=(0.040, 0.070), optimizer_end=0.075)
    phases = marks.phases(0.0, 0.080, exposed_comm_ms=10.0)
    assert phases == pytest.approx(
        {
            "micro_steps_ms": 30.0,
            "forward_ms": 10.0,
            "backward_ms": 20.0,
            "exposed_comm_ms": 10.0,
            "optimizer_ms": 5.0,
            "data_wait_ms": 5.0,
        }
    )
    assert sum(phases.values()) == pytest.approx(80.0)
    assert StepMarks(last_forward=0.0).phases(0.0, 0.01, None) is None  # no backward seen


def test_each_ranks_phases_and_idle_add_up_to_the_counted_step():
    fast = [_step(forward_ms=5.0, backward_ms=5.0, exposed_comm_ms=12.0)] * 4
    slow = [_step(forward_ms=15.0, backward_ms=5.0, exposed_comm_ms=1.0)] * 4
    counted = [22.0] * 4
    out = script_phases.rank_phases([fast, slow], counted)
    assert out is not None
    for rank in out:
        assert sum(rank["median"][p] for p in RANK_PHASES) == pytest.approx(22.0)
        assert rank["sum_error"] <= 0.05
    assert out[1]["median"]["idle_ms"] == pytest.approx(1.0)


def test_the_rank_that_sleeps_30_ms_in_every_forward_is_named_with_its_excess():
    # rank 1's compute is 30 ms longer; rank 0 waits for it in the all-reduce (exposed comm)
    steps = [
        [_step(forward_ms=5.0 + j % 3, backward_ms=8.0, exposed_comm_ms=31.0) for j in range(10)],
        [_step(forward_ms=35.0 + j % 2, backward_ms=8.0, exposed_comm_ms=1.0) for j in range(10)],
        [_step(forward_ms=5.0 + j % 2, backward_ms=8.0, exposed_comm_ms=31.0) for j in range(10)],
    ]
    (named,) = script_phases.stragglers(steps)
    assert named["rank"] == 1 and named["cause"] == "compute"
    assert named["excess_ms"] == pytest.approx(30.0, abs=1.0)
    assert script_phases.lost_points(50.0, 30.0) == pytest.approx(60.0)


def test_even_ranks_name_no_straggler_and_a_data_bound_rank_is_named_for_its_data():
    even = [[_step(forward_ms=5.0 + (j + r) % 2, backward_ms=8.0) for j in range(8)] for r in range(2)]
    assert script_phases.stragglers(even) == []
    starved = [even[0], [_step(forward_ms=5.0, backward_ms=8.0, data_wait_ms=20.0)] * 8]
    (named,) = script_phases.stragglers(starved)
    assert (named["rank"], named["cause"]) == (1, "data wait") and named["share"] > 0.5


def test_synced_micro_steps_fold_into_the_optimizer_step_that_ends_them():
    micro = {**_step(forward_ms=2.0, backward_ms=3.0), "optimizer_steps": 0, "samples": 8, "micro_steps": 1}
    last = {**_step(forward_ms=2.0, backward_ms=3.0, optimizer_ms=4.0), "samples": 8, "micro_steps": 1}
    for r in (micro, last):
        r["exposed_comm_ms"] = 0.0
    (step,) = script_phases.optimizer_steps([micro, micro, last, micro])  # the trailing one is unfinished
    assert (step["samples"], step["micro_steps"], step["step_ms"]) == (24, 3, 19.0)
    assert step["phases"]["micro_steps_ms"] == pytest.approx(10.0)
    assert sum(step["phases"].values()) == pytest.approx(step["step_ms"])


def test_an_optimizer_step_begun_in_the_warm_up_is_left_out():
    # Accelerate at one worker syncs both micro-steps: a warm-up of 3 synced steps ends inside the
    # second optimizer step, whose last micro-step alone was counted as a whole optimizer step
    micro = {**_step(forward_ms=2.0, backward_ms=3.0), "optimizer_steps": 0, "samples": 8, "micro_steps": 1}
    last = {**_step(forward_ms=2.0, backward_ms=3.0, optimizer_ms=4.0), "samples": 8, "micro_steps": 1}
    for r in (micro, last):
        r["exposed_comm_ms"] = 0.0
    steps = script_phases.optimizer_steps([micro, last] * 4, warmup=3)
    assert [(s["samples"], s["synced_steps"]) for s in steps] == [(16, 2), (16, 2)]
    assert script_phases.optimizer_steps([micro, last] * 4, warmup=2)[1:] == steps  # at a boundary: kept
    plain = [{**micro, "optimizer_steps": 0}] * 4  # no optimizer step seen: the window as it is
    assert script_phases.optimizer_steps(plain, warmup=3) == plain[3:]


def test_the_efficiency_lost_splits_into_parts_that_add_up_to_it():
    base = script_phases.rank_phases(
        [[_step(forward_ms=10.0, backward_ms=10.0, optimizer_ms=5.0)] * 3], [25.0] * 3
    )
    # at N=2: compute 2 ms slower on the fast rank, rank 1 +8 ms, 6 ms of comm, 1 ms more data wait
    fast = [
        _step(forward_ms=11.0, backward_ms=11.0, optimizer_ms=5.0, exposed_comm_ms=14.0, data_wait_ms=1.0)
    ] * 3
    slow = [
        _step(forward_ms=19.0, backward_ms=11.0, optimizer_ms=5.0, exposed_comm_ms=6.0, data_wait_ms=1.0)
    ] * 3
    named = script_phases.stragglers([fast, slow])
    phases = script_phases.rank_phases([fast, slow], [42.0] * 3)
    assert base is not None and phases is not None
    parts = script_phases.efficiency_lost(phases, base, named, efficiency=25.0 / 42.0, step_ms=42.0, work=1.0)
    assert list(parts) == list(script_phases.LOSSES)
    assert sum(parts.values()) == pytest.approx(100 * (1 - 25.0 / 42.0))
    assert parts["compute growth"] == pytest.approx(100 * 2.0 / 42.0)
    assert parts["straggler wait"] == pytest.approx(100 * 8.0 / 42.0)
    assert parts["exposed communication"] == pytest.approx(100 * 6.0 / 42.0)
    assert parts["data wait"] == pytest.approx(100 * 1.0 / 42.0)
    assert parts["rest"] == pytest.approx(0.0, abs=1e-9)
