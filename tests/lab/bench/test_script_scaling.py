"""`dpscale scale`'s figures from the ranks' step telemetry (the runs themselves: tests/run)."""

import json
from pathlib import Path

import pytest

from dpscale.lab.bench import script_scaling
from dpscale.lab.bench.script_scaling import ScaleConfig
from dpscale.lab.bench.script_scaling_report import format_table, warnings
from support.scale_records import measure as _measure
from support.scale_records import rank as _rank
from support.scale_records import step as _step


def _ranks(step_ms: list[float], samples: int) -> list[dict]:
    return [
        {
            "transport": "gloo",
            "host": "h",
            "records": [{"step_ms": t, "samples": samples, "exposed_comm_ms": None} for t in step_ms],
        }
    ]


def test_throughput_and_step_time_come_from_the_same_steps():
    # one step of five held up 20x by the host: the median step says 1 ms, so must samples/s;
    # the mean said 4.8 ms, halved the baseline's throughput and showed 205% efficiency at N=2
    config = ScaleConfig(script="train.py", world_sizes=[1], steps=5, warmup=0, threads_per_worker=1)
    point = script_scaling._point(1, "dpscale", _ranks([1.0, 1.0, 20.0, 1.0, 1.0], samples=8), config)
    assert point.step_ms == 1.0
    assert point.samples_per_s == 8 / 1e-3


def test_a_one_worker_run_without_ddp_is_the_baseline_and_its_row_says_so(monkeypatch):
    # the "wrap in DDP only when world_size > 1" script: one unwrapped rank at N=1 (today: "0 of 1
    # ranks wrapped a model", after the whole run)
    one = [_step({"forward_ms": 4.0, "backward_ms": 6.0}, samples=16)] * 6
    two = [_step({"forward_ms": 4.0, "backward_ms": 6.0, "exposed_comm_ms": 2.5}, samples=16)] * 6
    result = _measure(monkeypatch, {1: [_rank(one, ddp=False)], 2: [_rank(two, 0, 2), _rank(two, 1, 2)]}, 6)
    base, pair = result.points
    assert base.note is not None and "no DDP model at 1 worker" in base.note
    assert pair.efficiency == pytest.approx(10.0 / 12.5)
    assert result.profile is not None and result.profile["per_worker_batch_by_world_size"] == {
        "1": 16,
        "2": 16,
    }


def test_ranks_that_never_synchronize_get_no_efficiency_and_say_why(monkeypatch):
    alone = [_step({"forward_ms": 4.0, "backward_ms": 6.0}, samples=16)] * 4
    runs = {1: [_rank(alone, ddp=False)], 2: [_rank(alone, 0, 2, ddp=False), _rank(alone, 1, 2, ddp=False)]}
    pair = _measure(monkeypatch, runs, 4).points[1]
    assert not pair.synchronized and pair.efficiency is None
    assert pair.note is not None and "trained alone" in pair.note


def test_efficiency_compares_optimizer_steps_where_one_worker_syncs_every_micro_step(monkeypatch):
    # Accelerate at N=1 syncs each of 4 micro-steps (4 short steps, the optimizer in the last);
    # at N=2 one synced step holds all 4. Per synced step the N=1 median is a micro-step (8
    # samples in 10 ms) against N=2's whole step: the efficiency came out 57% for a perfect 100%
    micro = _step({"forward_ms": 4.0, "backward_ms": 6.0}, samples=8, optimizer_steps=0)
    last = _step({"forward_ms": 4.0, "backward_ms": 6.0, "optimizer_ms": 30.0}, samples=8)
    whole = _step(
        {"micro_steps_ms": 30.0, "forward_ms": 4.0, "backward_ms": 6.0, "optimizer_ms": 30.0}, samples=32
    )
    runs = {
        1: [_rank([micro, micro, micro, last] * 4)],
        2: [_rank([whole] * 16, 0, 2), _rank([whole] * 16, 1, 2)],
    }
    base, pair = _measure(monkeypatch, runs, 16).points
    assert base.samples_per_step == 32 and base.steps == 4  # optimizer steps
    assert pair.efficiency == pytest.approx(1.0)
    assert base.phases is not None and base.phases[0]["median"]["micro_steps_ms"] == pytest.approx(30.0)


def test_a_warm_up_that_ends_inside_an_optimizer_step_leaves_that_step_out(monkeypatch):
    # a Hugging Face Trainer with 2 micro-steps: Accelerate syncs both at N=1, so --warmup 3 ended
    # inside an optimizer step whose last micro-step was counted whole: 14.4 samples per optimizer
    # step at N=1, "each rank does 16 samples per optimizer step against 14.4" at N=2
    micro = _step({"forward_ms": 4.0, "backward_ms": 6.0}, samples=8, optimizer_steps=0)
    last = _step({"forward_ms": 4.0, "backward_ms": 6.0, "optimizer_ms": 2.0}, samples=8)
    whole = _step(
        {"micro_steps_ms": 10.0, "forward_ms": 4.0, "backward_ms": 6.0, "optimizer_ms": 2.0}, samples=16
    )
    runs = {1: [_rank([micro, last] * 7)], 2: [_rank([whole] * 13, 0, 2), _rank([whole] * 13, 1, 2)]}
    result = _measure(monkeypatch, runs, 10, warmup=3)
    base, pair = result.points
    assert (base.steps, base.samples_per_step, base.step_ms) == (4, 16, 22.0)
    assert pair.efficiency == pytest.approx(1.0) and pair.note is None
    assert result.profile is not None and result.profile["per_worker_batch"] == 16


def test_a_row_above_100_percent_says_why_where_each_rank_does_less_work(monkeypatch):
    # nanoGPT divides its accumulation by the world size: 32 samples per rank at N=1, 16 at N=2
    one = [_step({"micro_steps_ms": 60.0, "forward_ms": 10.0, "backward_ms": 10.0}, samples=32)] * 4
    two = [_step({"micro_steps_ms": 15.0, "forward_ms": 10.0, "backward_ms": 10.0}, samples=16)] * 4
    pair = _measure(monkeypatch, {1: [_rank(one)], 2: [_rank(two, 0, 2), _rank(two, 1, 2)]}, 4).points[1]
    assert pair.efficiency is not None and pair.efficiency > 1.0
    assert pair.note is not None
    assert "16 samples per optimizer step against 32 at N=1" in pair.note and "above 100%" in pair.note
    assert pair.note in format_table(
        _measure(monkeypatch, {1: [_rank(one)], 2: [_rank(two, 0, 2), _rank(two, 1, 2)]}, 4)
    )


def test_evaluation_steps_are_counted_apart_not_blamed_on_the_host(monkeypatch):
    # nanoGPT with --eval_interval: every 5th step 4x longer; the spread warning blamed host load
    plain = _step({"forward_ms": 4.0, "backward_ms": 6.0}, samples=8)
    evaluated = _step(
        {"forward_ms": 4.0, "backward_ms": 6.0, "data_wait_ms": 30.0}, samples=8, evaluations=10
    )
    saved = _step({"forward_ms": 4.0, "backward_ms": 6.0, "data_wait_ms": 30.0}, samples=8, checkpoints=1)
    result = _measure(monkeypatch, {1: [_rank([plain, plain, evaluated, plain, saved] * 3)]}, 15)
    (point,) = result.points
    assert (point.eval_steps, point.checkpoint_steps, point.steps) == (3, 3, 9)
    assert point.step_ms_p90 == point.step_ms == 10.0
    assert not warnings(result)
    assert point.note is not None and "3 held an evaluation and 3 held a checkpoint" in point.note


def test_the_step_in_which_other_ranks_wait_for_rank_0s_own_evaluation_is_counted_with_it(monkeypatch):
    # nanoGPT evaluates and saves on rank 0 only: rank 1 goes on into the next step and waits for
    # rank 0 in its all-reduce, a step counted at 194 ms against a median of 117 (p90, and the
    # exposed communication the diagnosis blamed)
    plain = _step({"forward_ms": 4.0, "backward_ms": 6.0}, samples=8)
    evaluated = _step({"forward_ms": 4.0, "backward_ms": 6.0, "data_wait_ms": 90.0}, samples=8, checkpoints=1)
    waited = _step({"forward_ms": 4.0, "backward_ms": 6.0, "exposed_comm_ms": 90.0}, samples=8)
    rank0 = [plain, plain, evaluated, plain] * 3
    rank1 = [plain, plain, plain, waited] * 3
    point = _measure(monkeypatch, {2: [_rank(rank0, 0, 2), _rank(rank1, 1, 2)]}, 12).points[0]
    assert (point.checkpoint_steps, point.steps) == (6, 6)
    assert point.step_ms_p90 == point.step_ms == 10.0 and point.exposed_comm_ms == 0.0
    assert point.phases is not None and point.phases[1]["p90"]["exposed_comm_ms"] == 0.0


def test_the_profile_books_accumulation_micro_steps_as_forward_and_backward_not_optimizer():
    # nanoGPT's 4 micro-steps: 3 before the synced one (300 ms), then 10 + 20 ms, optimizer 5 ms,
    # data 5 ms. The profile booked 310 of 340 ms as "optimizer"
    step = _step(
        {
            "micro_steps_ms": 300.0,
            "forward_ms": 10.0,
            "backward_ms": 20.0,
            "optimizer_ms": 5.0,
            "data_wait_ms": 5.0,
        },
        samples=32,
        micro_steps=4,
    )
    step["backward_total_ms"] = 80.0  # 4 backwards of 20 ms
    config = ScaleConfig(script="train.py", world_sizes=[1], steps=3, warmup=0, threads_per_worker=1)
    rank0 = _rank([step] * 3)
    profile = script_scaling.profile_from(rank0, config, script_scaling._point(1, "dpscale", [rank0], config))
    assert profile["optimizer_ms"] == pytest.approx(10.0)
    assert profile["backward_ms"] == pytest.approx(80.0) and profile["forward_ms"] == pytest.approx(250.0)


def test_a_script_that_all_reduces_on_every_accumulation_micro_step_is_told_to_use_no_sync(monkeypatch):
    micro = _step(
        {"forward_ms": 4.0, "backward_ms": 6.0, "exposed_comm_ms": 3.0}, samples=8, optimizer_steps=0
    )
    last = _step(
        {"forward_ms": 4.0, "backward_ms": 6.0, "exposed_comm_ms": 3.0, "optimizer_ms": 2.0}, samples=8
    )
    records = [micro, micro, micro, last] * 3
    runs = {1: [_rank(records)], 2: [_rank(records, 0, 2), _rank(records, 1, 2)]}
    result = _measure(monkeypatch, runs, 12)
    base, pair = result.points
    assert pair.synced_per_optimizer_step == 4
    # the 3 micro-steps' all-reduces before the last: 3 ms exposed each, of a 54 ms step
    assert pair.micro_step_comm_ms == pytest.approx(9.0) and base.micro_step_comm_ms is None
    text = format_table(result)
    assert "all-reduce on accumulation micro-steps (4 per optimizer step): 9.0 ms/step (16.7 points)" in text
    assert "model.no_sync()" in text


def test_a_script_without_ddp_across_hosts_is_told_so_not_that_ranks_did_not_train(monkeypatch, tmp_path):
    # across hosts the ranks' telemetry travels through the DDP model's group: a script without one
    # leaves each host only its own ranks' records, though every rank trained
    from dpscale.launch.nodes import Nodes

    def one_hosts_ranks(script, args, *, nproc, telemetry_dir, log_path, **kw):
        record = _rank([_step({"forward_ms": 1.0}, samples=4)] * 6, 1, 2) | {"ddp": False}
        (Path(telemetry_dir) / "rank1.json").write_text(json.dumps(record))
        log_path.write_text("trained\n")
        return 0

    monkeypatch.setattr(script_scaling, "run_script", one_hosts_ranks)
    nodes = Nodes(min_nodes=2, max_nodes=2, rdzv_endpoint="10.0.0.1:29400", rdzv_id="job")
    config = ScaleConfig(script="train.py", world_sizes=[1, 2], steps=4, warmup=0, threads_per_worker=1)
    with pytest.raises(script_scaling.ScriptFailed) as failed:
        script_scaling._measure_one(config, 2, "dpscale", tmp_path, nodes)
    message = str(failed.value).splitlines()[0]
    assert "1 of 2 ranks trained" not in message
    assert "built no torch.nn.parallel.DistributedDataParallel model" in message
    assert "2 hosts" in message


# a failed run's log as the launcher writes it (2026-12-03, a script raising at import, one rank):
# the script's traceback, torch's agent logging its own, then the launcher's error with torch's box
FAILED_RUN_LOG = """\
Traceback (most recent call last):
  File "/tmp/bad.py", line 2, in <module>
    raise RuntimeError("the script broke here")
RuntimeError: the script broke here
E1203 08:33:06.702000 2572 torch/distributed/elastic/multiprocessing/api.py:836] failed (exitcode: 1)
E1203 08:33:06.702000 2572 torch/distributed/elastic/multiprocessing/api.py:836] Traceback (most
E1203 08:33:06.702000 2572 torch/distributed/elastic/multiprocessing/api.py:836]     self._pc.join(-1)
dpscale: error: the script failed:

============================================================
entry FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-03_08:33:07
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 2585)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_a_failed_scripts_message_shows_its_traceback_not_torchs_summary_box(monkeypatch, tmp_path):
    # the message showed the log's last 15 lines: torch's failure box, exactly, and never the error
    def failing(script, args, *, nproc, telemetry_dir, log_path, **kw):
        log_path.write_text(FAILED_RUN_LOG)
        return 1

    monkeypatch.setattr(script_scaling, "run_script", failing)
    config = ScaleConfig(script="bad.py", world_sizes=[1], steps=4, warmup=0, threads_per_worker=1)
    with pytest.raises(script_scaling.ScriptFailed) as failed:
        script_scaling._measure_one(config, 1, "dpscale", tmp_path, None)
    message = str(failed.value)
    assert message.startswith("bad.py with 1 workers (dpscale) exited with code 1:\nTraceback")
    assert 'raise RuntimeError("the script broke here")' in message
    assert message.endswith("dpscale: error: the script failed:")
    assert "torch/distributed/elastic" not in message and "entry FAILED" not in message
