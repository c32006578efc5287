"""GlobalBatchSampler: layout, tail policies, determinism, resume across world sizes, user errors."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from dpscale.data.sampler import GlobalBatchSampler, StepBatch

# the whole file must run in seconds on a shared 2-core machine
SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def configs(draw, tails=("drop", "pad", "keep")):
    """A valid configuration: G is built from W, k and the micro-batch so it always divides."""
    world_size = draw(st.integers(1, 4))
    accumulation_steps = draw(st.integers(1, 3))
    micro = draw(st.integers(1, 4))
    global_batch = world_size * accumulation_steps * micro
    tail = draw(st.sampled_from(tails))
    # "drop" needs one complete global batch; the others also cover a dataset smaller than G
    dataset_size = draw(st.integers(global_batch if tail == "drop" else 1, 4 * global_batch))
    return dict(
        dataset_size=dataset_size,
        global_batch=global_batch,
        world_size=world_size,
        accumulation_steps=accumulation_steps,
        shuffle=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
        tail=tail,
    )


def all_ranks(cfg: dict, epoch: int = 0, **overrides) -> list[GlobalBatchSampler]:
    cfg = {**cfg, **overrides}
    n = cfg.pop("dataset_size")
    samplers = [GlobalBatchSampler(n, rank=r, **cfg) for r in range(cfg["world_size"])]
    for s in samplers:
        s.set_epoch(epoch)
    return samplers


def global_batches(samplers: list[GlobalBatchSampler]) -> list[list[int]]:
    """Each remaining step's samples over all ranks, in rank then micro-batch order."""
    per_rank = [list(s.iter_steps()) for s in samplers]
    return [
        [i for step in steps for mb in step.micro_batches for i in mb]
        for steps in zip(*per_rank, strict=True)
    ]


def reference_perm(cfg: dict, epoch: int) -> list[int]:
    """The documented order, computed independently of the sampler."""
    n = cfg["dataset_size"]
    if not cfg["shuffle"]:
        return list(range(n))
    return np.random.default_rng([cfg["seed"], epoch]).permutation(n).tolist()


@SETTINGS
@given(configs(tails=("drop",)), st.integers(0, 3))
def test_drop_uses_complete_global_batches_once(cfg, epoch):
    samplers = all_ranks(cfg, epoch)
    n, g = cfg["dataset_size"], cfg["global_batch"]
    batches = global_batches(samplers)
    assert len(batches) == n // g == samplers[0].steps_per_epoch
    # the layout itself: step b, concatenated over ranks in order, is perm[b*G:(b+1)*G]
    perm = reference_perm(cfg, epoch)
    assert batches == [perm[b * g : (b + 1) * g] for b in range(n // g)]
    used = [i for b in batches for i in b]
    assert len(used) == len(set(used)), "a sample was handed to two ranks or twice"


@SETTINGS
@given(configs(tails=("drop", "pad")), st.integers(0, 3))
def test_every_micro_batch_is_full_for_drop_and_pad(cfg, epoch):
    for s in all_ranks(cfg, epoch):
        micro_batches = list(s)
        assert len(micro_batches) == len(s)
        assert all(len(mb) == s.micro_batch for mb in micro_batches)


@SETTINGS
@given(configs(tails=("keep",)), st.integers(0, 3))
def test_keep_uses_every_sample_exactly_once(cfg, epoch):
    samplers = all_ranks(cfg, epoch)
    steps = [list(s.iter_steps()) for s in samplers]
    used = [i for rank_steps in steps for step in rank_steps for mb in step.micro_batches for i in mb]
    assert sorted(used) == list(range(cfg["dataset_size"]))
    for same_step in zip(*steps, strict=True):
        assert all(len(step.micro_batches) == cfg["accumulation_steps"] for step in same_step)
        total = sum(len(mb) for step in same_step for mb in step.micro_batches)
        assert {step.global_count for step in same_step} == {total}
    # only the last global batch may be smaller
    counts = [step.global_count for step in steps[0]]
    assert all(c == cfg["global_batch"] for c in counts[:-1])
    assert sum(counts) == cfg["dataset_size"]


@SETTINGS
@given(configs(tails=("pad",)), st.integers(0, 3))
def test_pad_covers_every_sample_and_pads_from_the_start(cfg, epoch):
    n, g = cfg["dataset_size"], cfg["global_batch"]
    batches = global_batches(all_ranks(cfg, epoch))
    assert len(batches) == -(-n // g)
    used = [i for b in batches for i in b]
    assert set(used) == set(range(n))
    perm = reference_perm(cfg, epoch)
    # the padding repeats the epoch's permutation from its start, cyclically if G > n
    assert used == (perm * (len(used) // n + 1))[: len(used)]


def test_keep_tail_can_leave_micro_batches_empty():
    # n = G + 1: the one leftover sample goes to rank 0's first micro-batch
    samplers = all_ranks(
        dict(dataset_size=9, global_batch=8, world_size=2, accumulation_steps=2, shuffle=False, seed=0),
        tail="keep",
    )
    tails = [list(s.iter_steps())[-1] for s in samplers]
    assert tails[0] == StepBatch(epoch=0, step_in_epoch=1, global_count=1, micro_batches=[[8], []])
    assert tails[1].micro_batches == [[], []]


@SETTINGS
@given(configs(), st.integers(0, 3))
def test_same_seed_and_epoch_give_the_same_order(cfg, epoch):
    first = [list(s) for s in all_ranks(cfg, epoch)]
    second = [list(s) for s in all_ranks(cfg, epoch)]
    assert first == second


@SETTINGS
@given(configs(), st.integers(0, 3))
def test_different_epochs_give_different_orders(cfg, epoch):
    # 20! orders: two equal permutations would be a bug, not chance
    cfg = {**cfg, "dataset_size": max(cfg["dataset_size"], 20, cfg["global_batch"]), "shuffle": True}
    assert [list(s) for s in all_ranks(cfg, epoch)] != [list(s) for s in all_ranks(cfg, epoch + 1)]


@SETTINGS
@given(st.integers(1, 6), st.integers(1, 40), st.sampled_from(["drop", "pad", "keep"]), st.booleans())
def test_one_rank_two_accumulation_steps_equals_two_ranks_one_step(micro, n, tail, shuffle):
    g = 2 * micro
    cfg = dict(
        dataset_size=max(n, g) if tail == "drop" else n, global_batch=g, shuffle=shuffle, seed=3, tail=tail
    )
    accumulate = global_batches(all_ranks(cfg, world_size=1, accumulation_steps=2))
    two_ranks = global_batches(all_ranks(cfg, world_size=2, accumulation_steps=1))
    assert [sorted(b) for b in accumulate] == [sorted(b) for b in two_ranks]


@st.composite
def resume_cases(draw):
    """Two (world_size, accumulation_steps) pairs that both divide one global batch."""
    before = (draw(st.integers(1, 3)), draw(st.integers(1, 2)))
    after = (draw(st.integers(1, 3)), draw(st.integers(1, 2)))
    global_batch = before[0] * before[1] * after[0] * after[1] * draw(st.integers(1, 2))
    tail = draw(st.sampled_from(["drop", "pad", "keep"]))
    dataset_size = draw(st.integers(global_batch if tail == "drop" else 1, 4 * global_batch))
    seed = draw(st.integers(0, 99))
    cfg = dict(dataset_size=dataset_size, global_batch=global_batch, shuffle=True, seed=seed, tail=tail)
    steps = -(-dataset_size // global_batch) if tail != "drop" else dataset_size // global_batch
    return cfg, before, after, draw(st.integers(0, steps)), draw(st.integers(0, 2))


@SETTINGS
@given(resume_cases())
def test_resume_with_another_world_size_continues_the_same_global_batches(case):
    cfg, (w1, k1), (w2, k2), taken, epoch = case
    uninterrupted = global_batches(all_ranks(cfg, epoch, world_size=w1, accumulation_steps=k1))
    before = all_ranks(cfg, epoch, world_size=w1, accumulation_steps=k1)
    for s in before:
        for _ in range(taken):
            next(s.iter_steps())
    state = before[-1].state_dict()
    assert state["step_in_epoch"] == taken and state["epoch"] == epoch
    after = all_ranks(cfg, world_size=w2, accumulation_steps=k2)
    for s in after:
        s.load_state_dict(state)
    resumed = global_batches(after)
    assert [sorted(b) for b in resumed] == [sorted(b) for b in uninterrupted[taken:]]


def test_position_advances_with_the_last_micro_batch_of_a_step():
    s = GlobalBatchSampler(40, global_batch=8, world_size=2, rank=1, accumulation_steps=2)
    it = iter(s)
    next(it)
    # half a step taken: its accumulated gradient is in no checkpoint, so the step must be redone
    assert s.state_dict()["step_in_epoch"] == 0
    next(it)
    assert s.state_dict()["step_in_epoch"] == 1
    fresh = GlobalBatchSampler(40, global_batch=8, world_size=2, rank=1, accumulation_steps=2)
    fresh.load_state_dict(s.state_dict())
    assert list(fresh) == list(it)


def test_exhausted_epoch_yields_nothing_until_set_epoch():
    s = GlobalBatchSampler(10, global_batch=4, world_size=1, rank=0, shuffle=False)
    assert list(s) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert list(s) == [] and list(s.iter_steps()) == []
    s.set_epoch(0)
    assert len(list(s)) == len(s) == 2


def test_state_dict_is_plain_and_round_trips():
    s = GlobalBatchSampler(50, global_batch=10, world_size=1, rank=0, seed=7, tail="pad")
    s.set_epoch(3)
    next(s.iter_steps())
    state = s.state_dict()
    assert state == dict(
        epoch=3,
        step_in_epoch=1,
        sample_offset=0,
        dataset_size=50,
        global_batch=10,
        seed=7,
        shuffle=True,
        tail="pad",
    )
    assert all(type(v) in (int, str, bool) for v in state.values())


@pytest.mark.parametrize(
    "field, value",
    [("dataset_size", 60), ("global_batch", 5), ("seed", 8), ("shuffle", False), ("tail", "keep")],
)
def test_load_rejects_a_state_from_another_configuration(field, value):
    s = GlobalBatchSampler(50, global_batch=10, world_size=2, rank=0, seed=7, tail="pad")
    state = {**s.state_dict(), field: value}
    with pytest.raises(ValueError, match=rf"saved {field} {value!r} differs"):
        s.load_state_dict(state)


def test_load_rejects_a_position_past_the_epoch():
    s = GlobalBatchSampler(50, global_batch=10, world_size=1, rank=0)
    with pytest.raises(ValueError, match="step_in_epoch 6"):
        s.load_state_dict({**s.state_dict(), "step_in_epoch": 6})


def make(n=100, **kwargs):
    return GlobalBatchSampler(n, **{"global_batch": 12, "world_size": 2, "rank": 0, **kwargs})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n=0), r"dataset_size 0 must be at least 1"),
        (dict(global_batch=0), r"global_batch 0 must be at least 1"),
        (dict(world_size=0), r"world_size 0 must be at least 1"),
        (dict(rank=2), r"rank 2 must be in \[0, 2\)"),
        (dict(rank=-1), r"rank -1 must be in \[0, 2\)"),
        (dict(accumulation_steps=0), r"accumulation_steps 0 must be at least 1"),
        (dict(seed=-1), r"seed -1 must be non-negative"),
        (dict(tail="repeat"), r"tail 'repeat' is not one of 'drop', 'pad', 'keep'"),
        (
            dict(global_batch=10, world_size=3),
            r"global_batch 10 is not divisible by world_size 3 x accumulation_steps 1 = 3; "
            r"choose a global batch that is a multiple of 3 \(e\.g\. 9 or 12\)",
        ),
        (
            dict(global_batch=3, world_size=2, accumulation_steps=2),
            r"global_batch 3 is smaller than world_size 2 x accumulation_steps 2 = 4.*at least 4",
        ),
        (
            dict(n=10, global_batch=12),
            r"global_batch 12 > dataset_size 10 leaves no complete global batch with tail='drop'",
        ),
    ],
)
def test_invalid_configuration_names_the_numbers_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        make(**kwargs)
    assert "\n" not in str(err.value)


def test_set_epoch_rejects_negative():
    with pytest.raises(ValueError, match="epoch -1"):
        make().set_epoch(-1)


@pytest.mark.parametrize("tail", ["drop", "pad"])
def test_works_as_a_data_loader_batch_sampler(tail):
    data = torch.arange(100) * 10
    sampler = GlobalBatchSampler(100, global_batch=12, world_size=2, rank=1, accumulation_steps=3, tail=tail)
    expected = list(
        GlobalBatchSampler(100, global_batch=12, world_size=2, rank=1, accumulation_steps=3, tail=tail)
    )
    loader = DataLoader(TensorDataset(data), batch_sampler=sampler)
    assert len(loader) == len(expected)
    got = [batch.tolist() for (batch,) in loader]
    assert got == [[10 * i for i in mb] for mb in expected]
    assert Counter(len(b) for b in got) == {2: len(expected)}


# -- a new global batch mid-epoch (the trainer's world_change=scale-lr) --------------------------


@st.composite
def regroup_cases(draw):
    cfg = draw(configs(tails=("drop", "keep")))
    steps = GlobalBatchSampler(
        cfg["dataset_size"], rank=0, **{k: v for k, v in cfg.items() if k != "dataset_size"}
    )
    taken = draw(st.integers(0, steps.steps_per_epoch))
    w2, k2, micro2 = draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 4))
    return cfg, taken, dict(world_size=w2, accumulation_steps=k2, global_batch=w2 * k2 * micro2)


@SETTINGS
@given(regroup_cases())
def test_a_regrouped_epoch_goes_on_from_the_next_unused_sample(case):
    """Whatever the old and new global batch, the rest of the epoch's permutation is used in order,
    each sample once: each new step takes the next slice of it (a dropped tail of the new grouping
    aside), and an epoch the old grouping had finished is not reopened."""
    cfg, taken, new = case
    if new["global_batch"] > cfg["dataset_size"] and cfg["tail"] == "drop":
        return  # no complete global batch at all: the constructor refuses, tested elsewhere
    epoch = 1
    order = reference_perm(cfg, epoch)
    before = all_ranks(cfg, epoch)
    for s in before:
        for _ in range(taken):
            next(s.iter_steps())
    state = before[0].state_dict()
    used = min(taken * cfg["global_batch"], cfg["dataset_size"])
    after = all_ranks(cfg, **new)
    for s in after:
        s.load_state_dict(state, regroup=True)
    if taken == before[0].steps_this_epoch and new["global_batch"] != cfg["global_batch"]:
        assert (after[0].epoch, after[0].sample_offset, after[0].step_in_epoch) == (epoch + 1, 0, 0)
        return
    rest = global_batches(after)
    g = new["global_batch"]
    for j, batch in enumerate(rest):
        assert sorted(batch) == sorted(order[used + j * g : used + (j + 1) * g])
    left = cfg["dataset_size"] - used - sum(len(b) for b in rest)
    assert left == 0 if cfg["tail"] == "keep" else 0 <= left < g


def test_regroup_offset_survives_another_save_and_load():
    s = GlobalBatchSampler(40, global_batch=8, world_size=2, rank=0, shuffle=False)
    next(s.iter_steps())
    t = GlobalBatchSampler(40, global_batch=4, world_size=1, rank=0, shuffle=False)
    t.load_state_dict(s.state_dict(), regroup=True)
    assert (t.sample_offset, t.step_in_epoch, t.steps_this_epoch, t.steps_per_epoch) == (8, 0, 8, 10)
    assert next(t.iter_steps()).micro_batches == [[8, 9, 10, 11]]
    u = GlobalBatchSampler(40, global_batch=4, world_size=2, rank=1, shuffle=False)
    u.load_state_dict(t.state_dict())
    assert next(u.iter_steps()).micro_batches == [[14, 15]]
    u.set_epoch(1)
    assert u.sample_offset == 0 and u.steps_this_epoch == 10


def test_another_global_batch_needs_regroup():
    s = GlobalBatchSampler(40, global_batch=8, world_size=2, rank=0)
    with pytest.raises(ValueError, match="saved global_batch 8 differs"):
        GlobalBatchSampler(40, global_batch=4, world_size=1, rank=0).load_state_dict(s.state_dict())


def test_load_rejects_an_offset_outside_the_dataset():
    s = GlobalBatchSampler(40, global_batch=8, world_size=1, rank=0)
    with pytest.raises(ValueError, match="sample_offset 41"):
        s.load_state_dict({**s.state_dict(), "sample_offset": 41})
