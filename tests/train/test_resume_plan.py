"""Resume planning without processes: TrainState's round trip and checks, the batch split, the step budget."""

from types import SimpleNamespace

import pytest

from dpscale.train.checkpoint.files import CheckpointError
from dpscale.train.checkpoint.resume import BatchSplit, check_resumable, plan_split, plan_total_steps
from dpscale.train.optim import BatchScale
from dpscale.train.state import TrainState


def state(**kw) -> TrainState:
    base = dict(world_size=2, global_batch=64, base_global_batch=64, micro_batch=16, accumulation_steps=2)
    return TrainState(**{**base, **kw})


def test_train_state_round_trips_and_loads_in_place():
    saved = state(
        step=7, samples_seen=448, skipped_steps=1, last_loss=0.5, batch_scale=BatchScale(2.0, 1.0, 3, 4)
    )
    target = state()
    scale = target.batch_scale
    target.load_state_dict(saved.state_dict())
    assert target == saved
    assert target.batch_scale is scale, "the scheduler holds the batch scale: it must change in place"


@pytest.mark.parametrize(
    "doc, words",
    [
        ([1, 2], "holds a list, not a dict"),
        ({"step": -1}, "step is -1, not a valid count"),
        ({**state().state_dict(), "world_size": 0}, "world_size is 0"),
        ({**state().state_dict(), "batch_scale": {"target": 0.0}}, "batch scale"),
    ],
)
def test_a_malformed_train_state_is_refused_naming_the_file(doc, words):
    with pytest.raises(CheckpointError, match=words):
        TrainState.from_state_dict(doc, "ckpt/trainer.pt")


def test_an_old_train_state_without_base_batch_or_split_loads():
    doc = {k: v for k, v in state().state_dict().items() if k not in ("base_global_batch", "micro_batch")}
    old = TrainState.from_state_dict(doc)
    assert old.base_global_batch == 64 and old.micro_batch is None


def test_another_global_batch_cannot_resume():
    with pytest.raises(ValueError, match="trained with global_batch 64, this run asks for 32"):
        check_resumable(state(), global_batch=32, world_change="keep-global-batch", where="c")
    moved = state(global_batch=96)
    with pytest.raises(ValueError, match="--world-change scale-lr"):
        check_resumable(moved, global_batch=64, world_change="keep-global-batch", where="c")
    check_resumable(moved, global_batch=64, world_change="scale-lr", where="c")


def test_a_grown_batch_resumes_only_under_global_batch_auto():
    grown = state(
        global_batch=256, micro_batch=16, accumulation_steps=8, batch_growth={"changes": [[8, 128]]}
    )
    check_resumable(grown, global_batch=64, world_change="keep-global-batch", where="c", auto_batch=True)
    with pytest.raises(
        ValueError, match="had grown to global batch 256 under global_batch auto; resume with"
    ):
        check_resumable(grown, global_batch=64, world_change="keep-global-batch", where="c")
    for corrupt in (96, 32, 64 * 32):  # not 64 x 2^j, below the start, past the 16x cap
        with pytest.raises(
            CheckpointError, match=f"{corrupt} is not the start batch 64 times a power of two"
        ):
            check_resumable(
                state(global_batch=corrupt), global_batch=64, world_change="x", where="c", auto_batch=True
            )


def split(
    saved,
    world_size,
    current,
    world_change="keep-global-batch",
    global_batch=64,
    split_given=True,
    auto_batch=False,
):
    return plan_split(
        saved,
        world_size=world_size,
        current=current,
        global_batch=global_batch,
        configured_global_batch=64,
        world_change=world_change,
        split_given=split_given,
        where="c",
        auto_batch=auto_batch,
    )


def test_global_batch_auto_goes_on_at_the_grown_batch_wherever_it_splits():
    grown = state(global_batch=256, micro_batch=16, accumulation_steps=8)
    assert split(grown, 2, BatchSplit(16, 2), auto_batch=True) == BatchSplit(16, 8)  # as saved
    assert split(grown, 4, BatchSplit(16, 1), auto_batch=True) == BatchSplit(16, 4)  # 256 kept
    assert split(grown, 1, BatchSplit(16, 4), auto_batch=True) == BatchSplit(16, 16)
    assert split(grown, 3, BatchSplit(7, 3), auto_batch=True, global_batch=63) == BatchSplit(7, 3)  # start
    assert split(state(), 2, BatchSplit(32, 1), auto_batch=True) == BatchSplit(32, 1)  # never grew


def test_same_world_keeps_the_configured_split():
    assert split(state(), 2, BatchSplit(32, 1)) == BatchSplit(32, 1)


def test_same_world_without_a_configured_split_keeps_the_checkpoints():
    # trained 16 x 2 (--micro-batch 16); a plain --resume must not move to the default 32 x 1:
    # twice the memory per forward, and another order of summation than the run it continues
    assert split(state(), 2, BatchSplit(32, 1), split_given=False) == BatchSplit(16, 2)
    # an older checkpoint without a split: the configuration's
    assert split(state(micro_batch=None), 2, BatchSplit(32, 1), split_given=False) == BatchSplit(32, 1)


def test_keep_global_batch_keeps_the_micro_batch_and_changes_accumulation():
    assert split(state(), 4, BatchSplit(16, 1)) == BatchSplit(16, 1)
    assert split(
        state(world_size=4, micro_batch=8, accumulation_steps=2), 2, BatchSplit(32, 1)
    ) == BatchSplit(8, 4)
    # a micro-batch that does not divide: the configuration's split stays
    assert split(
        state(micro_batch=32, accumulation_steps=1), 3, BatchSplit(7, 3), global_batch=63
    ) == BatchSplit(7, 3)


def test_scale_lr_keeps_each_workers_batch_and_refuses_an_inconsistent_file():
    assert split(state(), 3, BatchSplit(21, 1), "scale-lr") == BatchSplit(16, 2)
    with pytest.raises(CheckpointError, match="the file is corrupt"):
        split(state(micro_batch=5), 3, BatchSplit(21, 1), "scale-lr")
    with pytest.raises(CheckpointError, match="the file is corrupt"):
        split(
            state(world_size=1, global_batch=128, micro_batch=128, accumulation_steps=1),
            2,
            BatchSplit(32, 1),
            "scale-lr",
        )


def position(epoch=0, step_in_epoch=0, steps_this_epoch=22, steps_per_epoch=22):
    return SimpleNamespace(
        epoch=epoch,
        step_in_epoch=step_in_epoch,
        steps_this_epoch=steps_this_epoch,
        steps_per_epoch=steps_per_epoch,
    )


def test_step_budget_by_max_steps_and_by_epochs():
    assert plan_total_steps(state(step=5), max_steps=30, epochs=3, sampler=position()) == 30
    assert plan_total_steps(state(step=0), max_steps=None, epochs=3, sampler=position()) == 66
    assert plan_total_steps(state(step=30), max_steps=None, epochs=3, sampler=position(1, 8)) == 30 + 14 + 22
    assert plan_total_steps(state(step=66), max_steps=None, epochs=3, sampler=position(3, 0)) == 66


def test_after_a_batch_change_the_budget_is_kept_in_samples():
    # 10 steps at 64 done; now 96 per step: the 20 x 64 samples left take ceil(1280 / 96) = 14 steps
    moved = state(step=10, samples_seen=640, global_batch=96, batch_scale=BatchScale(1.5, 1.0, 10, 20))
    assert plan_total_steps(moved, max_steps=30, epochs=1, sampler=position()) == 10 + 14
    # back at the configured batch but with a ramp behind it: still counted in samples
    back = state(step=10, samples_seen=640, batch_scale=BatchScale(1.0, 1.5, 10, 20))
    assert plan_total_steps(back, max_steps=30, epochs=1, sampler=position()) == 30


def test_a_batch_grown_and_halved_back_keeps_the_budget_in_samples():
    # --global-batch auto: 6 steps at 16, 4 at 32, back at 16; 60 x 16 samples take 46 more steps
    back = state(
        step=10, samples_seen=6 * 16 + 4 * 32, global_batch=16, base_global_batch=16, batch_changed=True
    )
    assert plan_total_steps(back, max_steps=60, epochs=1, sampler=position()) == 10 + 46
    # and the mark survives a checkpoint, and an older checkpoint's moved batch reads as a change
    assert TrainState.from_state_dict(back.state_dict()).batch_changed
    older = {k: v for k, v in state(global_batch=96).state_dict().items() if k != "batch_changed"}
    assert TrainState.from_state_dict(older).batch_changed
    with pytest.raises(CheckpointError, match="batch_changed is 1, not a bool"):
        TrainState.from_state_dict({**back.state_dict(), "batch_changed": 1})
