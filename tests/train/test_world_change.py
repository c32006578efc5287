"""A resume at another world size with world_change=scale-lr: per-worker batch kept, global batch and
LR follow by the linear rule (ramped), the sample budget and the epoch's sample order kept; and a
PowerSGD run's hook state survives a checkpoint."""

import json
import shutil

import pytest
import torch
import torch.distributed as dist

from dpscale.lab.multirank import MultiRankError, run_ranks
from dpscale.train.checkpoint.files import CheckpointError
from dpscale.train.config import TrainConfig
from dpscale.train.trainer import Trainer
from support.forge import replace_checkpoint_file
from support.recording import record_batches

# digits: 1,438 training samples; 64 per global batch gives 22 steps per epoch
BASE = dict(
    workload="digits",
    global_batch=64,
    optimizer="sgd",
    lr=0.1,
    progress="none",
    seed=3,
    world_change="scale-lr",
    rescale_warmup_steps=4,
)


def fit_and_record(rank, world, cfg):
    trainer = Trainer(TrainConfig.from_flat(**cfg))
    seen = record_batches(trainer)
    return trainer.fit().to_dict(), seen


def all_samples(per_rank):
    return [i for _, seen in per_rank for _, batch in seen for i in batch]


@pytest.fixture(scope="module")
def two_then_one(tmp_path_factory):
    """10 steps on 2 workers (global batch 64), then resumed on 1 worker to the same budget."""
    root = tmp_path_factory.mktemp("world_change")
    ckpt = root / "ckpt"
    first = run_ranks(fit_and_record, 2, {**BASE, "max_steps": 10, "checkpoint_dir": str(ckpt)})
    early = root / "early"
    shutil.copytree(ckpt, early)  # the step-10 checkpoint, for other continuations (copy it first)
    rest = run_ranks(
        fit_and_record,
        1,
        {**BASE, "max_steps": 20, "checkpoint_dir": str(ckpt), "resume": True, "metrics_dir": str(root)},
    )
    return root, early, first, rest


@pytest.mark.slow
def test_the_global_batch_follows_the_workers_and_the_sample_budget_is_kept(two_then_one):
    _, _, first, rest = two_then_one
    ((resumed, _),) = rest
    assert resumed["resumed_from_step"] == 10
    assert (resumed["world_size"], resumed["global_batch"]) == (1, 32)
    assert (resumed["micro_batch"], resumed["accumulation_steps"]) == (32, 1), "the per-worker batch"
    # budget: max_steps x the configured batch = 20 x 64 samples; 640 taken in 10 steps, 640 left
    assert resumed["samples_seen"] == 20 * 64 and resumed["steps"] == 10 + 640 // 32
    # one epoch's permutation: each sample at most once, none skipped at the change of grouping
    samples = all_samples(first) + all_samples(rest)
    assert len(samples) == len(set(samples)) == 20 * 64
    assert {epoch for _, seen in first + rest for epoch, _ in seen} == {0}


@pytest.mark.slow
def test_the_lr_ramps_to_the_linear_rule(two_then_one):
    root, *_ = two_then_one
    lines = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    lrs = {m["step"]: m["lr"] for m in lines}
    assert min(lrs) == 11, "metrics of the resumed part"
    # from 0.1 (global batch 64) to 0.1 * 32 / 64 over 4 steps, then held
    expected = {11: 0.0875, 12: 0.075, 13: 0.0625, 14: 0.05, 15: 0.05, 30: 0.05}
    assert {s: pytest.approx(lrs[s]) for s in expected} == expected


@pytest.mark.slow
def test_a_second_resume_at_the_new_size_continues_bit_exactly(two_then_one):
    """Stop the 1-worker part in the middle of its LR ramp (budget 11 x 64 ends at step 12; the ramp
    runs from step 11 to 14) and resume it: the same parameters as the uninterrupted 1-worker part,
    so the ramp and the regrouped sampler position went through the checkpoint."""
    root, early, _, rest = two_then_one
    ((whole, _),) = rest
    ckpt = root / "second"
    shutil.copytree(early, ckpt)
    ((half, _),) = run_ranks(
        fit_and_record, 1, {**BASE, "max_steps": 11, "checkpoint_dir": str(ckpt), "resume": True}
    )
    assert half["steps"] == 12 and half["global_batch"] == 32
    ((end, _),) = run_ranks(
        fit_and_record, 1, {**BASE, "max_steps": 20, "checkpoint_dir": str(ckpt), "resume": True}
    )
    assert end["resumed_from_step"] == 12 and end["steps"] == 30
    assert end["param_sha256"] == whole["param_sha256"]


@pytest.mark.slow
def test_a_world_the_configured_batch_does_not_split_over_takes_the_saved_per_worker_batch(two_then_one):
    """64 does not split over 3 workers; scale-lr keeps 32 per worker, so the global batch is 96."""
    root, early, _, _ = two_then_one
    ckpt = root / "three"
    shutil.copytree(early, ckpt)
    results = run_ranks(
        fit_and_record, 3, {**BASE, "max_steps": 12, "checkpoint_dir": str(ckpt), "resume": True}
    )
    r = results[0][0]
    assert (r["world_size"], r["global_batch"], r["micro_batch"]) == (3, 96, 32)
    # 12 x 64 - 640 = 128 samples left: two steps of 96
    assert r["steps"] == 12 and r["samples_seen"] == 640 + 2 * 96


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.slow
def test_keep_global_batch_refuses_a_checkpoint_whose_batch_scale_lr_changed(two_then_one, world_of_one):
    root, *_ = two_then_one
    cfg = TrainConfig.from_flat(
        **{**BASE, "world_change": "keep-global-batch"},
        max_steps=40,
        checkpoint_dir=str(root / "ckpt"),
        resume=True,
    )
    with pytest.raises(ValueError, match="had moved to global batch 32 under world_change=scale-lr"):
        Trainer(cfg).fit()


@pytest.mark.slow
def test_without_a_checkpoint_the_configured_batch_must_split(tmp_path):
    """Nothing to resume from: 3 workers cannot split 64, and every rank says so."""
    cfg = {**BASE, "max_steps": 1, "checkpoint_dir": str(tmp_path), "resume": True}
    with pytest.raises(MultiRankError) as err:
        run_ranks(fit_and_record, 3, cfg, timeout_s=60)
    assert str(err.value).count("global_batch 64 is not divisible by the world size 3") == 3


@pytest.mark.slow
def test_a_second_change_keeps_the_sample_budget(two_then_one):
    """2 workers to step 10, 1 to step 16, 2 again to the end: the budget (20 x 64 samples) holds
    although the batch is back at the configured 64 (the run now counts samples, not steps)."""
    root, early, _, _ = two_then_one
    ckpt = root / "twice"
    shutil.copytree(early, ckpt)
    cfg = {**BASE, "checkpoint_dir": str(ckpt), "resume": True}
    ((mid, _),) = run_ranks(fit_and_record, 1, {**cfg, "max_steps": 13})  # budget 13 x 64 = 640 + 6 x 32
    assert (mid["steps"], mid["samples_seen"]) == (16, 832)
    (end, _), _ = run_ranks(fit_and_record, 2, {**cfg, "max_steps": 20})
    assert end["global_batch"] == 64 and end["samples_seen"] == 20 * 64
    assert end["steps"] == 16 + (1280 - 832) // 64


@pytest.mark.slow
def test_epochs_are_not_exceeded_after_a_regroup_at_the_end(tmp_path):
    """A finished 1-epoch run resumed on fewer workers has nothing left to do, under either policy."""
    ckpt = tmp_path / "ckpt"
    cfg = {**BASE, "epochs": 1, "checkpoint_dir": str(ckpt)}
    (done, _), _ = run_ranks(fit_and_record, 2, cfg)
    assert done["steps"] == 22
    for policy in ("scale-lr", "keep-global-batch"):
        ((again, seen),) = run_ranks(fit_and_record, 1, {**cfg, "resume": True, "world_change": policy})
        assert again["steps"] == 22 and seen == [], policy


def test_a_checkpoint_from_before_world_change_resumes(tmp_path, world_of_one):
    """trainer.pt without base_global_batch and batch_scale, and no comm_hook file: still loads."""
    ckpt = tmp_path / "ckpt"
    Trainer(TrainConfig.from_flat(**BASE, max_steps=2, checkpoint_dir=str(ckpt))).fit()
    step_dir = ckpt / "step-00000002"
    assert not (step_dir / "comm_hook.pt").exists()
    state = torch.load(step_dir / "trainer.pt", weights_only=True)
    del state["base_global_batch"], state["batch_scale"]
    replace_checkpoint_file(step_dir, "trainer.pt", state)
    result = Trainer(TrainConfig.from_flat(**BASE, max_steps=3, checkpoint_dir=str(ckpt), resume=True)).fit()
    assert (result.resumed_from_step, result.steps) == (2, 3)


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(batch_scale={"target": float("inf"), "start": 1.0, "from_step": 0, "steps": 0}), "finite"),
        (dict(batch_scale={"target": 1.0, "start": 1.0, "from_step": 2.5, "steps": 0}), "steps counts"),
        (dict(global_batch=10**9, micro_batch=10**9 // 2, world_size=2), "exceeds the configured"),
    ],
)
def test_a_forged_world_change_state_is_refused_naming_the_file(tmp_path, world_of_one, change, words):
    ckpt = tmp_path / "ckpt"
    Trainer(TrainConfig.from_flat(**BASE, max_steps=2, checkpoint_dir=str(ckpt))).fit()
    step_dir = ckpt / "step-00000002"
    state = torch.load(step_dir / "trainer.pt", weights_only=True)
    replace_checkpoint_file(step_dir, "trainer.pt", {**state, **change})
    with pytest.raises(CheckpointError) as err:
        Trainer(TrainConfig.from_flat(**BASE, max_steps=3, checkpoint_dir=str(ckpt), resume=True)).fit()
    assert str(step_dir / "trainer.pt") in str(err.value) and words in str(err.value)


def fit(rank, world, cfg):
    return Trainer(TrainConfig.from_flat(**cfg)).fit().to_dict()


@pytest.mark.slow
def test_a_powersgd_run_resumes_with_its_hook_state(tmp_path):
    """PowerSGD compresses from step 11; stopping at 12 and resuming must equal the run that never
    stopped: the Qs, the per-rank errors and the step count come back (without them the resumed run
    would average uncompressed again for 10 steps)."""
    base = dict(workload="digits", compression="powersgd", progress="none", seed=1)
    whole, _ = run_ranks(fit, 2, {**base, "max_steps": 14})
    ckpt = str(tmp_path / "ckpt")
    run_ranks(fit, 2, {**base, "max_steps": 12, "checkpoint_dir": ckpt})
    resumed, _ = run_ranks(fit, 2, {**base, "max_steps": 14, "checkpoint_dir": ckpt, "resume": True})
    assert resumed["resumed_from_step"] == 12
    assert resumed["param_sha256"] == whole["param_sha256"]
    # on one worker instead: the two ranks' errors merge into one, the step count goes on
    (iteration,) = run_ranks(
        hook_iteration, 1, {**base, "max_steps": 15, "checkpoint_dir": ckpt, "resume": True}
    )
    assert iteration == 15


def hook_iteration(rank, world, cfg):
    trainer = Trainer(TrainConfig.from_flat(**cfg))
    trainer.fit()
    return trainer.comm_state.iteration
