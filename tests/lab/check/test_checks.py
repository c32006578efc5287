"""`dpscale check equivalence` checks that W workers and k accumulation steps reproduce the full
batch for a task (catching batch-dependent layers); `check unused` names parameters."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpscale.lab.check import equivalence, unused

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_per_sample_loss_is_equivalent():
    r = equivalence.run(
        "check_models:per_sample_loss", world_size=2, accumulation_steps=2, global_batch=8, steps=2
    )
    assert r.ok and all(c.rel_diff < 1e-5 for c in r.comparisons)


def test_a_summed_scalar_loss_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match='pass reduction="none"'):
        equivalence.run("check_models:sum_loss", world_size=2, accumulation_steps=4, global_batch=8, steps=2)


@pytest.mark.slow
def test_data_a_task_module_draws_at_import_is_the_same_on_every_rank():
    # each spawned rank imports the module afresh; unseeded, each drew its own data and the check
    # said "NOT equivalent" for a plain per-sample loss
    r = equivalence.run("module_data_task:make", world_size=2, accumulation_steps=2, global_batch=8, steps=2)
    assert r.ok and all(c.rel_diff < 1e-5 for c in r.comparisons)


@pytest.mark.slow
def test_batch_norm_is_caught():
    r = equivalence.run(
        "check_models:batch_norm", world_size=2, accumulation_steps=2, global_batch=8, steps=2
    )
    assert not r.ok and "BatchNorm" in r.comparisons[0].hint


@pytest.mark.slow
def test_dict_inputs_are_split_and_fed_like_the_trainer_does():
    r = equivalence.run(
        "check_models:dict_inputs", world_size=2, accumulation_steps=2, global_batch=8, steps=2
    )
    assert r.ok and all(c.rel_diff < 1e-5 for c in r.comparisons)
    assert unused.run("check_models:dict_inputs").never_used == []


@pytest.mark.slow
def test_builtin_workload_passes():
    assert equivalence.run("digits", world_size=2, accumulation_steps=2, global_batch=8, steps=1).ok


def test_bad_input_names_the_flag():
    with pytest.raises(ValueError, match="--global-batch 10 must be divisible by --accumulation-steps 4"):
        equivalence.run("digits", world_size=2, accumulation_steps=4, global_batch=10)
    with pytest.raises(ValueError, match="--model"):
        equivalence.run("no such model")


def test_unused_parameters_are_listed_and_the_flag_recommended_only_when_needed():
    r = unused.run("check_models:alternating", steps=2)
    assert r.unused_per_step == [
        ["never.weight", "never.bias"],
        ["extra.weight", "extra.bias", "never.weight", "never.bias"],
    ]
    assert r.never_used == ["never.bias", "never.weight"]
    assert r.sometimes_unused == ["extra.bias", "extra.weight"]
    assert "find_unused_parameters=True" in r.recommendation
    assert "keep find_unused_parameters=False" in unused.run("digits").recommendation
    assert "freeze" in unused.run("check_models:never_used").recommendation


@pytest.mark.slow
def test_cli_exit_codes():
    env_path = str(HERE)
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpscale.cli.main",
            "check",
            "equivalence",
            "--model",
            "check_models:batch_norm",
            "--global-batch",
            "8",
            "--steps",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": env_path},
    )
    assert ok.returncode == 1 and "NOT equivalent" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "dpscale.cli.main", "check", "unused", "--model", "nope:x"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": env_path},
    )
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
