"""Growing the global batch with the noise scale: the decision, and a real run that grows."""

import argparse
import json
import shutil
import types

import pytest
import torch
from test_noise_scale_train import _task as regression_task  # tests/train is on sys.path

from dpscale.engine.clock import EventClock
from dpscale.flags import add_dataclass_arguments, dataclass_kwargs
from dpscale.lab.multirank import run_ranks
from dpscale.train.adaptive import auto_batch
from dpscale.train.adaptive.adascale import AdaScaleGain
from dpscale.train.adaptive.auto_batch import GrowBatch
from dpscale.train.config import TrainConfig
from dpscale.train.trainer import Trainer
from support.fake_events import FakeDevice


def test_the_batch_doubles_while_the_noise_scale_reaches_it_and_stops_at_the_cap():
    grow = GrowBatch(max_global_batch=256, grow_at=1.0)
    want = grow.wanted_accumulation
    assert want(b_simple=None, global_batch=32, accumulation=1) == 1
    assert want(b_simple=31.0, global_batch=32, accumulation=1) == 1  # not yet at the batch
    assert want(b_simple=32.0, global_batch=32, accumulation=1) == 2
    assert want(b_simple=100.0, global_batch=32, accumulation=2) == 8  # 32 -> 64 -> 128, not 256
    assert want(b_simple=1e6, global_batch=32, accumulation=2) == 16  # up to the cap, 256
    assert want(b_simple=1e6, global_batch=256, accumulation=16) == 16
    assert want(b_simple=-5.0, global_batch=32, accumulation=1) == 1  # a noisy negative estimate
    # grow_at 2 (the default): the doubled batch stays at or below the noise scale
    default = GrowBatch(max_global_batch=256).wanted_accumulation
    assert default(b_simple=63.0, global_batch=32, accumulation=1) == 1
    assert default(b_simple=64.0, global_batch=32, accumulation=1) == 2
    with pytest.raises(ValueError):
        GrowBatch(max_global_batch=0)
    with pytest.raises(ValueError, match="grow_at"):
        GrowBatch(max_global_batch=8, grow_at=0)


def test_step_times_decide_whether_a_doubling_pays():
    """Time to target ~ (1 + B_noise/B) x t(B): a larger batch pays only while its step costs
    less than the steps it saves."""
    want = GrowBatch(max_global_batch=1024, grow_at=1.0).wanted_accumulation
    # only the current batch timed: one doubling, a probe
    assert want(b_simple=1e4, global_batch=32, accumulation=1, step_s={1: 0.01}) == 2
    # a step that costs the same at any batch (overhead-bound): up to the cap at once
    assert want(b_simple=1e4, global_batch=64, accumulation=2, step_s={1: 0.01, 2: 0.01}) == 32
    # a step whose time doubles with the batch (compute-bound): never pays ...
    assert want(b_simple=100.0, global_batch=32, accumulation=1, step_s={1: 0.01, 2: 0.02}) == 1
    # ... and a probe that measured so goes back, when clearly slower (by 10%: load noise)
    assert want(b_simple=100.0, global_batch=64, accumulation=2, step_s={1: 0.01, 2: 0.02}) == 1
    assert want(b_simple=100.0, global_batch=64, accumulation=2, step_s={1: 0.01, 2: 0.017}) == 2
    # between: digits-like times (ms) at B_noise 50 over 32-sample micro-steps: 64 is best
    times = {1: 4.5, 2: 5.1, 4: 9.8}
    assert want(b_simple=50.0, global_batch=64, accumulation=2, step_s=times) == 2
    assert want(b_simple=50.0, global_batch=128, accumulation=4, step_s=times) == 2


def _time_to_target(step_s, *, base, noise, k=1, grow=None, s_min=200):
    """A run on McCandlish's law, no clock: a step at batch B makes 1 / (S_min (1 + B_noise / B))
    of the way, B_noise grows linearly with the way made, a step at k costs step_s[k]; `grow`
    decides every 4 steps after 8, from the noise scale and the step times of the batches tried."""
    way, time, step, tried = 0.0, 0.0, 0, {}
    while way < 1:
        way += 1 / (s_min * (1 + noise(way) / (base * k)))
        time += step_s[k]
        tried[k], step = step_s[k], step + 1
        if grow is not None and step % 4 == 0 and step >= 8:
            k = grow.wanted_accumulation(
                b_simple=noise(way), global_batch=base * k, accumulation=k, step_s=dict(tried)
            )
    return time


def test_the_rule_beats_every_fixed_batch_where_the_step_has_a_fixed_cost_and_the_noise_grows():
    def grows(way):  # 8 -> 800 samples over the run
        return 8 + 792 * way

    overhead_bound = {1: 1.0, 2: 1.2, 4: 1.6, 8: 2.4, 16: 4.0}
    fixed = [_time_to_target(overhead_bound, base=8, noise=grows, k=k) for k in overhead_bound]
    auto = _time_to_target(overhead_bound, base=8, noise=grows, grow=GrowBatch(max_global_batch=128))
    assert auto < 0.99 * min(fixed)
    # a step proportional to the batch (the transformer here): the smallest batch is the fastest
    # at every noise scale, and the rule keeps it, whatever the noise scale does
    proportional = {k: float(k) for k in overhead_bound}
    fixed = [_time_to_target(proportional, base=8, noise=grows, k=k) for k in proportional]
    auto = _time_to_target(proportional, base=8, noise=grows, grow=GrowBatch(max_global_batch=128))
    assert min(fixed) == fixed[0] and auto == pytest.approx(fixed[0], rel=0.02)


def _fake_trainer(step, b_simple, updates=20):
    state = types.SimpleNamespace(global_batch=32, micro_batch=16, accumulation_steps=2)
    calls = []

    def set_batch_split(micro, accumulation):
        calls.append((micro, accumulation))
        state.accumulation_steps, state.global_batch = accumulation, micro * accumulation

    estimator = types.SimpleNamespace(updates=updates)
    noise = types.SimpleNamespace(b_simple=b_simple, estimator=estimator)
    trainer = types.SimpleNamespace(
        step=step,
        state=state,
        noise_scale=noise,
        set_batch_split=set_batch_split,
        plan_total_steps=lambda: 99,
    )
    return trainer, calls


def test_decisions_come_every_check_every_steps_after_enough_measurements():
    grow = GrowBatch(max_global_batch=1024, check_every=8, min_updates=8, grow_at=1.0)
    for step, updates in ((7, 20), (8, 3)):  # off the schedule; too few measurements
        trainer, calls = _fake_trainer(step, 500.0, updates)
        grow.after_step(trainer)
        assert calls == []
    trainer, calls = _fake_trainer(16, 40.0)  # no step timed: the noise scale alone decides
    grow.after_step(trainer)
    assert calls == [(16, 4)] and trainer.total_steps == 99  # 32 -> 64, steps replanned
    assert grow.changes == [(16, 64)]


def test_step_times_come_from_the_trainers_clock_read_after_the_steps_sync():
    # CUDA events (here: fake ones with set times); read at after_step, once the step flags'
    # read has let the device pass them
    device = FakeDevice([0.0, 5.0, 25.0, 30.0, 60.0])
    grow = GrowBatch(max_global_batch=1024)
    trainer, _ = _fake_trainer(1, None)
    trainer.clock = EventClock(device.event)
    for _ in range(3):
        grow.on_batch(trainer, None)
        grow.after_reduce(trainer, [])
        device.run_until()
        grow.after_step(trainer)
    assert grow.step_s == {2: [pytest.approx(0.02), pytest.approx(0.03)]}  # the first step: not timed


def test_the_ranks_step_times_are_averaged_on_the_groups_device(monkeypatch):
    # CUDA workers reduce over NCCL, which takes no CPU tensor: the times go where the group needs them
    grow = GrowBatch(max_global_batch=64)
    grow.step_s = {1: [0.02, 0.01], 2: [0.03]}
    seen = []

    class Reduced(Exception):
        pass

    def all_reduce(tensor, group=None):
        seen.append((tensor.device, tensor.tolist() if tensor.device.type == "cpu" else None))
        raise Reduced

    monkeypatch.setattr("torch.distributed.is_initialized", lambda: True)
    monkeypatch.setattr("torch.distributed.all_reduce", all_reduce)
    for device in ("cpu", "meta"):  # meta: any device but the CPU (none here has a GPU)
        monkeypatch.setattr(auto_batch, "collective_device", lambda group, d=device: torch.device(d))
        with pytest.raises(Reduced):
            grow.agreed_step_s(types.SimpleNamespace(group=None, device=torch.device("cpu")))
    assert seen == [(torch.device("cpu"), [0.01, 0.03]), (torch.device("meta"), None)]


def _grow_run(rank, world, cfg):
    # step times that make the doubled batch twice as dear per sample, whatever this host's speed:
    # the probe of 32 is then halved back to 16 (this rank process is the only one patched)
    GrowBatch.agreed_step_s = lambda self, trainer: {k: 0.01 * k * k for k in self.step_s}
    grow = GrowBatch(max_global_batch=128, check_every=4, min_updates=4, grow_at=1.0)
    result = Trainer(TrainConfig.from_flat(**cfg), callbacks=[grow, AdaScaleGain(base_batch=16)]).fit()
    return result.to_dict(), grow.changes


@pytest.mark.slow
def test_a_run_grows_its_batch_and_keeps_counting_samples(tmp_path):
    # digits' noise scale (tens of samples) is past 16 within a few dozen steps
    cfg = dict(workload="digits", global_batch=16, micro_batch=8, max_steps=60, noise_scale_every=1)
    cfg |= dict(progress="none", metrics_dir=str(tmp_path), lr=0.05)
    (result, changes), _ = run_ranks(_grow_run, 2, cfg, timeout_s=300)
    assert [batch for _, batch in changes][:2] == [32, 16] and result["global_batch"] == changes[-1][1]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    seen = [line["samples_seen"] for line in lines]
    steps_at_16 = changes[0][0]
    assert seen[steps_at_16 - 1] == 16 * steps_at_16  # 16 per step until the first change ...
    assert seen[steps_at_16] - seen[steps_at_16 - 1] == changes[0][1]  # ... then the grown batch
    # the budget of 60 steps x 16 is kept in samples once the batch grew, also after it came back
    # to 16 (resume.plan_total_steps; it went back to counting steps: 60 steps, 1,024 samples)
    assert result["samples_seen"] >= 60 * 16 and result["steps"] < 60
    assert lines[-1]["loss"] < 0.95 * lines[0]["loss"]  # it still trains after the change


# ---- --global-batch auto -------------------------------------------------------------------------


def test_global_batch_auto_starts_at_the_default_and_survives_the_trip_to_the_workers():
    config = TrainConfig.from_flat(workload="digits", global_batch="auto")
    assert (config.data.global_batch, config.adaptive.auto_batch) == (64, True)
    assert TrainConfig.from_dict(config.to_dict()).adaptive.auto_batch is True
    with pytest.raises(ValueError, match="^global_batch auto: engine torch does not measure"):
        TrainConfig.from_flat(workload="digits", global_batch="auto", engine="torch")
    TrainConfig.from_flat(
        workload="digits", global_batch="auto", resume=True, checkpoint_dir="/tmp/x"
    )  # resumes
    with pytest.raises(ValueError, match="^global_batch auto keeps the batch it grew to"):
        TrainConfig.from_flat(workload="digits", global_batch="auto", world_change="scale-lr")
    with pytest.raises(ValueError, match="^global_batch auto: a growing batch needs the noise scale"):
        TrainConfig.from_flat(workload="digits", global_batch="auto", no_noise_scale=True)


def test_the_growth_state_round_trips_and_a_bad_one_is_refused():
    grow = GrowBatch(max_global_batch=256)
    grow.changes, grow.agreed_s = [(8, 128), (16, 64)], {1: 0.01, 2: 0.015}
    saved = grow.state_dict()
    again = GrowBatch(max_global_batch=256)
    again.load_state_dict(saved, same_world=True)
    assert again.changes == [(8, 128), (16, 64)] and again.step_s == {1: [0.01], 2: [0.015]}
    other = GrowBatch(max_global_batch=256)
    other.load_state_dict(saved, same_world=False)  # a step's time depends on the world size
    assert other.changes == [(8, 128), (16, 64)] and other.step_s == {} and other.agreed_s == {}
    for bad in ({"changes": [[8]], "fastest_s": {}}, {"changes": [], "fastest_s": {1: -1.0}}, [1]):
        with pytest.raises(ValueError, match="batch growth"):
            GrowBatch(max_global_batch=256).load_state_dict(bad, same_world=True)


def test_the_summary_says_how_the_batch_grew_also_after_the_trip_through_json(capsys):
    from dpscale.train.result import TrainResult, print_summary

    fields = dict(world_size=2, micro_batch=32, accumulation_steps=1, steps=66, samples_seen=4224)
    fields |= dict(final_loss=0.1, test_accuracy=None, samples_per_s=1.0, param_sha256="0", checkpoint=None)
    fields |= dict(skipped_steps=0, resumed_from_step=None, engine="dpscale", transport="shm")
    grew = TrainResult(global_batch=64, **fields, global_batch_schedule=[(0, 64), (20, 128), (28, 64)])
    print_summary(TrainResult(**json.loads(json.dumps(grew.to_dict()))))  # as launch reads it back
    assert (
        "global batch auto                     64, 128 after step 20, 64 after step 28"
        in capsys.readouterr().err
    )
    print_summary(TrainResult(global_batch=64, **fields, global_batch_schedule=[(0, 64)]))
    assert "64 throughout (the noise scale never made a doubling pay)" in capsys.readouterr().err
    print_summary(TrainResult(global_batch=64, **fields))  # a fixed batch: no such row
    assert "global batch auto" not in capsys.readouterr().err


def test_the_global_batch_flag_takes_auto_or_a_number():
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, TrainConfig)
    assert (
        dataclass_kwargs(parser.parse_args(["--global-batch", "auto"]), TrainConfig)["global_batch"] == "auto"
    )
    assert dataclass_kwargs(parser.parse_args(["--global-batch", "32"]), TrainConfig)["global_batch"] == 32
    with pytest.raises(ValueError, match="^--global-batch: 'big' is neither"):
        dataclass_kwargs(parser.parse_args(["--global-batch", "big"]), TrainConfig)


def _auto_run(rank, world, cfg):
    # no step times: the noise scale alone decides (wanted_accumulation's documented case), so the
    # outcome does not depend on how fast this host ran each batch (the goodput side has
    # process-free tests with given times); this rank process is the only one patched
    GrowBatch.agreed_step_s = lambda self, trainer: {}
    trainer = Trainer(TrainConfig.from_flat(**cfg), regression_task())
    result = trainer.fit()
    grow = next(c for c in trainer.callbacks if isinstance(c, GrowBatch))
    return result.to_dict(), grow.changes


@pytest.mark.slow
def test_global_batch_auto_grows_to_the_measured_noise_scale():
    # the linear regression of test_noise_scale_train at fixed weights (lr 0): B_simple ~ 480
    # samples throughout (481-527 by brute force), so 64 doubles while 2 G <= B_simple: to 256,
    # and to 512 when the estimate then is above 512 (its step is overhead-bound: the step times
    # do not stop the doublings; the test takes the step times out, so the host's speed cannot)
    cfg = dict(global_batch="auto", lr=0.0, optimizer="sgd", momentum=0.0, max_steps=40)
    cfg |= dict(progress="none", drift_check_every=0, noise_scale_every=1, seed=1)
    (result, changes), _ = run_ranks(_auto_run, 2, cfg, timeout_s=300)
    final = result["global_batch"]
    assert final in (256, 512) and changes[-1][1] == final, changes
    assert result["global_batch_schedule"] == [(0, 64), *changes]  # what the summary shows
    assert final <= 1.1 * result["gradient_noise_scale"], (changes, result["gradient_noise_scale"])


def _auto_resume_run(rank, world, cfg, dear_from=None):
    # given step times: 10 ms at every accumulation below `dear_from`, 100 ms from it on. What the
    # decisions see depends on which accumulations were timed, the state a resume must carry, and
    # not on this host's speed (this rank process is the only one patched)
    def agreed(self, trainer):
        return {k: 0.1 if dear_from and k >= dear_from else 0.01 for k in sorted(self.step_s)}

    GrowBatch.agreed_step_s = agreed
    trainer = Trainer(TrainConfig.from_flat(**cfg), regression_task())
    result = trainer.fit()
    return result.to_dict(), trainer._growth.step_s


AUTO = dict(global_batch="auto", micro_batch=32, lr=1e-3, optimizer="sgd", momentum=0.0, max_steps=120)
AUTO |= dict(progress="none", drift_check_every=0, noise_scale_every=1, seed=1, checkpoint_every=4)


def _from_step_16(full_dir, to):
    """A checkpoint directory holding only the full run's step 16, as a restarted attempt finds it."""
    shutil.copytree(full_dir / "step-00000016", to / "step-00000016")
    return str(to)


@pytest.mark.slow
def test_a_growing_batch_resumes_at_the_batch_it_grew_to_bit_exactly(tmp_path):
    # the regression's noise scale (~500 samples) grows the batch from 64 within the first 16 steps
    full_dir = tmp_path / "full"
    (full, _), _ = run_ranks(
        _auto_resume_run, 2, AUTO | dict(checkpoint_dir=str(full_dir), keep_checkpoints=9)
    )
    schedule = full["global_batch_schedule"]
    assert schedule[0] == (0, 64) and len(schedule) > 2 and schedule[2][0] <= 16, schedule
    ckpt = _from_step_16(full_dir, tmp_path / "resumed")
    (resumed, _), _ = run_ranks(_auto_resume_run, 2, AUTO | dict(checkpoint_dir=ckpt, resume=True))
    assert resumed["resumed_from_step"] == 16
    assert resumed["global_batch_schedule"] == schedule  # the changes before 16 came with the checkpoint
    assert (resumed["samples_seen"], resumed["steps"]) == (full["samples_seen"], full["steps"])
    assert resumed["param_sha256"] == full["param_sha256"]
    # at another world size the grown batch is kept (more accumulation), the step times are not
    ckpt = _from_step_16(full_dir, tmp_path / "one")
    ((alone, times),) = run_ranks(_auto_resume_run, 1, AUTO | dict(checkpoint_dir=ckpt, resume=True))
    before = [c for c in schedule if c[0] <= 16]
    assert alone["global_batch_schedule"][: len(before)] == before, alone["global_batch_schedule"]
    assert all(step > 16 for step, _ in alone["global_batch_schedule"][len(before) :])
    assert alone["samples_seen"] >= 120 * 64  # the same budget in samples
    # only the accumulations one worker ran were timed (at W=2 the batch of 16 steps had k <= 8)
    assert min(times) >= before[-1][1] // 32, times


@pytest.mark.slow
def test_a_resumed_run_remembers_the_probe_that_did_not_pay(tmp_path):
    # a step of 128 costs 10x one of 64: the probe at step 8 is halved back at 12 and, knowing both
    # times, the run stays at 64. A resume that forgot the times would probe 128 again at step 20.
    full_dir = tmp_path / "full"
    cfg = AUTO | dict(checkpoint_dir=str(full_dir), keep_checkpoints=9, max_steps=40)
    (full, _), _ = run_ranks(_auto_resume_run, 2, cfg, 2)
    assert full["global_batch_schedule"] == [(0, 64), (8, 128), (12, 64)]
    ckpt = _from_step_16(full_dir, tmp_path / "resumed")
    (resumed, _), _ = run_ranks(_auto_resume_run, 2, cfg | dict(checkpoint_dir=ckpt, resume=True), 2)
    assert resumed["global_batch_schedule"] == full["global_batch_schedule"]
    assert resumed["param_sha256"] == full["param_sha256"]
