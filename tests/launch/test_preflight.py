"""Preflight checks a Task it is given: it never builds one itself, so it never imports the trainer."""

import ast
from pathlib import Path

import pytest

import dpscale.launch.preflight as preflight_module
from dpscale.launch.preflight import check_config, preflight
from dpscale.train.config import TrainConfig
from dpscale.workloads.builtin import WORKLOADS


def test_preflight_imports_nothing_of_the_trainer():
    tree = ast.parse(Path(preflight_module.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m and m.startswith("dpscale.train.trainer")}, imported


def test_preflight_checks_the_task_it_is_given():
    cfg = TrainConfig.from_flat(workload="digits", global_batch=10**6)
    task = WORKLOADS["digits"].task(cfg.seed)
    with pytest.raises(ValueError, match="fewer than one global batch of 1000000"):
        preflight(cfg, task)
    preflight(TrainConfig(workload="digits"), task)


def test_check_config_refuses_a_batch_that_does_not_split():
    with pytest.raises(ValueError):
        check_config(TrainConfig.from_flat(workload="digits", global_batch=10), [3])
