"""emulate_validate: how an emulated cluster's run is predicted, without starting one (no process).

A host under load slows the emulation's transfers and its compute; the check of the training step
takes both levels from the run it checks, so that what it tests (how the model composes a step)
does not move with the load (tests/lab/predict/test_emulate.py runs a real emulation)."""

from dataclasses import replace

import pytest
from predict_lab.emulate import EmulationConfig, EmulationResult
from predict_lab.emulate_validate import EMULATION_TARGET, validate_emulation

from dpscale.lab.predict.profile import explicit

PROFILE = explicit(
    params=6_300_000, bytes_per_param=4, step_compute_ms=16.0, backward_fraction=2 / 3, per_worker_batch=16
)


def _run(rate_gbit: float, allreduce_ms: float, train_ms: float, local_ms: float = 29.0) -> EmulationResult:
    config = EmulationConfig(hosts=2, rate_gbit=rate_gbit, per_worker_batch=16, sizes_bytes=[4 << 20])
    return EmulationResult(
        config=config,
        allreduce=[{"bytes": 4 << 20, "time_us": allreduce_ms * 1e3}],
        local_step_ms=local_ms,
        train_step_ms=train_ms,
        train_comm_ms=None,
        transport="gloo",
    )


def _predicted(rate_gbit: float) -> tuple[float, float]:
    """What the model says a run on links of `rate_gbit` takes: (4 MiB all-reduce, train step) in ms."""
    ar, train = validate_emulation(_run(rate_gbit, 1.0, 1.0), PROFILE)
    return ar.predicted_ms, train.predicted_ms


@pytest.mark.parametrize("slower", [1.0, 1.5, 2.5])
def test_a_load_that_slows_the_transfers_does_not_move_the_check_with_the_link_from_the_run(slower):
    # a 1 Gbit/s run on a host so loaded that its transfers went at 1/slower of the rate: it measures
    # what the model predicts for a link that much slower
    ar_ms, train_ms = _predicted(1.0 / slower)
    run = _run(1.0, ar_ms, train_ms)
    ar, train = validate_emulation(run, PROFILE, link_from_run=True)
    assert ar.measured_ms == ar_ms and abs(train.error_pct) < 1.0, train
    # at the tbf rate the same run misses by the load's share (the check before #16's fourth round)
    (_, at_tbf) = validate_emulation(run, PROFILE)
    if slower == 1.0:
        assert abs(at_tbf.error_pct) < 1.0
    else:
        assert at_tbf.error_pct < -100 * EMULATION_TARGET


def test_the_profiles_step_to_step_variation_is_not_counted_on_top_of_the_runs_slowest_rank():
    run = _run(1.0, 34.0, 250.0)
    steady = validate_emulation(run, replace(PROFILE, compute_cv=0.0))[-1].predicted_ms
    noisy = validate_emulation(run, replace(PROFILE, compute_cv=0.5))[-1].predicted_ms
    assert noisy == steady  # the measured compute level is the slowest rank's already


def test_the_compute_level_is_the_runs_bare_step():
    quick = validate_emulation(_run(1.0, 34.0, 250.0, local_ms=20.0), PROFILE)[-1].predicted_ms
    slow = validate_emulation(_run(1.0, 34.0, 250.0, local_ms=40.0), PROFILE)[-1].predicted_ms
    # the explicit profile's gradients become ready through backward, so part of the reduction
    # hides behind it: a slower compute adds at most its own 20 ms to the step
    assert 0 < slow - quick <= 20.0 + 1e-9
