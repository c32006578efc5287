"""TrainConfig in sections: each section checks itself, the flat names (flags, TOML, to_dict) map
onto them one to one, and the old flat keywords still work for a release with a warning."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from dpscale.errors import ConfigError
from dpscale.train.config import (
    FLAT,
    AdaptiveConfig,
    CheckpointConfig,
    DataConfig,
    EngineConfig,
    MetricsConfig,
    OptimConfig,
    TrainConfig,
)

# the keys a checkpoint, the launcher's spec and a result's JSON hold, in their order (start_over and
# run_id: the run's identity, issue 34)
RECORDED_KEYS = [
    "workload", "task", "global_batch", "micro_batch", "accumulation_steps", "epochs", "max_steps",
    "optimizer", "lr", "momentum", "weight_decay", "lr_reference_batch", "warmup_steps", "world_change",
    "rescale_warmup_steps", "grad_clip_norm", "seed", "tail", "checkpoint_dir", "checkpoint_every",
    "keep_checkpoints", "max_skipped_steps", "resume", "start_over", "run_id", "metrics_dir", "log_every",
    "progress", "engine", "bucket_cap_mb", "transport", "compression", "collective_timeout_s",
    "drift_check_every", "check_collectives_steps", "device", "precision", "data_workers", "no_noise_scale",
    "auto_batch", "noise_scale_every", "trace", "trace_steps",
]  # fmt: skip


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: DataConfig(micro_batch=2, accumulation_steps=2), "micro_batch and accumulation_steps"),
        (lambda: DataConfig(data_workers=-1), "data_workers must be >= 0"),
        (lambda: OptimConfig(lr=-1.0), "lr must be a number >= 0"),
        (lambda: OptimConfig(momentum=1.0), "momentum must be in"),
        (lambda: CheckpointConfig(resume=True), "resume needs checkpoint_dir"),
        (lambda: CheckpointConfig(dir="ck", keep=0), "keep_checkpoints must be a positive integer"),
        (lambda: CheckpointConfig(every=-1, dir="ck"), "checkpoint_every must be >= 0"),
        (lambda: EngineConfig(name="torch", transport="shm"), "engine 'torch' uses the process group"),
        (lambda: EngineConfig(bucket_cap_mb=float("nan")), "bucket_cap_mb must be a finite number"),
        (lambda: MetricsConfig(progress="loud"), "progress: unknown 'loud'"),
        (lambda: AdaptiveConfig(auto_batch=True, no_noise_scale=True), "needs the noise scale"),
    ],
)
def test_each_section_checks_its_own_fields_naming_the_flag(build, message):
    with pytest.raises(ConfigError, match=message):
        build()


def test_rules_that_join_sections_are_checked_by_the_run():
    with pytest.raises(ConfigError, match="engine torch does not measure the noise scale"):
        TrainConfig(
            workload="synthetic", adaptive=AdaptiveConfig(auto_batch=True), engine=EngineConfig(name="torch")
        )
    scale_lr = CheckpointConfig(dir="ck", world_change="scale-lr")
    with pytest.raises(ConfigError, match="drop world_change scale-lr"):
        TrainConfig(workload="synthetic", adaptive=AdaptiveConfig(auto_batch=True), checkpoint=scale_lr)
    with pytest.raises(ConfigError, match=r"optim must be OptimConfig\(...\), got dict"):
        TrainConfig(workload="synthetic", optim={"lr": 0.1})  # type: ignore[arg-type]


def test_the_task_fills_the_sections_it_leaves_unset():
    cfg = TrainConfig(workload="mlp", optim=OptimConfig(momentum=0.5))
    assert (cfg.data.global_batch, cfg.optim.optimizer, cfg.optim.lr) == (128, "sgd", 0.01)
    assert cfg.optim.momentum == 0.5
    assert TrainConfig(workload="mlp", max_steps=3).epochs is None, "max_steps stands for the epochs"


def test_sections_and_the_run_are_frozen():
    cfg = TrainConfig(workload="synthetic")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optim.lr = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 1  # type: ignore[misc]
    resumed = dataclasses.replace(cfg, checkpoint=CheckpointConfig(dir="ck", resume=True))
    assert resumed.checkpoint.resume and resumed.optim == cfg.optim


def test_the_flat_names_build_the_nested_config_and_to_dict_gives_them_back_in_the_recorded_order():
    cfg = TrainConfig.from_flat(
        workload="mlp", lr=0.5, checkpoint_dir="ck", keep_checkpoints=2, engine="torch"
    )
    assert cfg.optim.lr == 0.5 and cfg.checkpoint == CheckpointConfig(dir="ck", keep=2)
    assert cfg.engine == EngineConfig(name="torch")
    assert list(cfg.to_dict()) == RECORDED_KEYS == list(FLAT)
    assert cfg.to_dict()["checkpoint_dir"] == "ck" and cfg.to_dict()["engine"] == "torch"
    assert TrainConfig.from_dict(cfg.to_dict() | {"from_a_later_version": 1}) == cfg
    auto = TrainConfig.from_flat(workload="synthetic", global_batch="auto")
    assert auto.adaptive.auto_batch and auto.data.global_batch == 128
    with pytest.raises(TypeError, match="globl_batch"):
        TrainConfig.from_flat(globl_batch=4)


def test_flat_keywords_still_build_the_config_with_one_deprecation_line():
    with pytest.warns(DeprecationWarning) as said:
        old = TrainConfig(workload="synthetic", checkpoint_dir="ck", lr=0.2)  # the deprecated flat form
    assert len(said) == 1 and "\n" not in str(said[0].message)
    assert "TrainConfig(checkpoint=CheckpointConfig(dir=...))" in str(said[0].message)
    assert old == TrainConfig.from_flat(workload="synthetic", checkpoint_dir="ck", lr=0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the nested form and from_flat say nothing
        TrainConfig(workload="synthetic", engine=EngineConfig(), checkpoint=CheckpointConfig(dir="ck"))
        TrainConfig.from_flat(workload="synthetic", checkpoint_dir="ck")
