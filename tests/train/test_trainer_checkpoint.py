"""The trainer's checkpoints: failures reach every rank, and a checksum-valid but wrong file is refused."""

import pytest
import torch
import torch.distributed as dist

from dpscale.lab.multirank import MultiRankError, run_ranks
from dpscale.train.checkpoint.files import CheckpointError
from dpscale.train.config import TrainConfig
from dpscale.train.trainer import Trainer
from support.forge import replace_checkpoint_file

BASE = dict(workload="synthetic", max_steps=2, progress="none", drift_check_every=0)


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def fit(rank, world, cfg):
    return Trainer(TrainConfig.from_flat(**cfg)).fit().steps


@pytest.mark.slow
def test_a_checkpoint_rank_0_cannot_write_stops_every_rank(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(MultiRankError) as err:
        run_ranks(fit, 2, {**BASE, "checkpoint_dir": str(blocker)}, timeout_s=60)
    report = str(err.value)
    rank0, rank1 = report.split("--- rank 1")
    assert f"cannot create checkpoint root {blocker}" in rank0
    assert "RuntimeError: rank 0 could not write the checkpoint of step 2" in rank1
    assert "timed out" not in report, "rank 1 must learn of the failure, not wait for it"


@pytest.mark.parametrize(
    "name,content,words",
    [
        ("trainer.pt", {"step": -1}, "step is -1, not a valid count"),
        ("model.pt", {"net.0.weight": torch.zeros(3)}, "does not fit this run"),
        ("sampler.pt", {"epoch": 0}, "does not fit this run"),
    ],
)
def test_checksum_valid_but_wrong_content_is_refused_naming_the_file(
    tmp_path, world_of_one, name, content, words
):
    ckpt = tmp_path / "ckpt"
    Trainer(TrainConfig.from_flat(**BASE, checkpoint_dir=str(ckpt))).fit()
    bad = replace_checkpoint_file(ckpt / "step-00000002", name, content)
    trainer = Trainer(
        TrainConfig.from_flat(**{**BASE, "max_steps": 4}, checkpoint_dir=str(ckpt), resume=True)
    )
    with pytest.raises(CheckpointError) as err:
        trainer.fit()
    assert str(bad) in str(err.value) and words in str(err.value)


def test_a_plain_resume_keeps_the_runs_micro_batch_and_is_bit_exact(tmp_path, world_of_one):
    # trained with --micro-batch 8 (4 accumulation steps); `--resume` without it must go on with
    # 8 x 4, not the default 32 x 1 (4x the memory per forward, another summation order)
    run = dict(BASE, global_batch=32, seed=1, max_steps=4)
    whole = Trainer(TrainConfig.from_flat(**run, micro_batch=8)).fit()
    ckpt = str(tmp_path / "ckpt")
    Trainer(TrainConfig.from_flat(**{**run, "max_steps": 2}, micro_batch=8, checkpoint_dir=ckpt)).fit()
    result = Trainer(TrainConfig.from_flat(**run, checkpoint_dir=ckpt, resume=True)).fit()
    assert (result.micro_batch, result.accumulation_steps) == (8, 4)
    assert result.param_sha256 == whole.param_sha256
