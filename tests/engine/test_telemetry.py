"""Step telemetry on the engine's clock: CUDA events (fake ones here) read once complete.

The limit counts steps as they run, so every rank stops at the same step whatever its device has
finished; records wait for their events and are all read when the telemetry is written.
"""

import gc
import sys
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from dpscale.engine.clock import EventClock
from dpscale.engine.telemetry import Span, StepTelemetry, TorchTelemetryDDP, _timed
from support.fake_events import FakeDevice


def test_records_wait_for_their_events_and_the_limit_counts_steps_as_they_run():
    device = FakeDevice([0.0, 7.0, 10.0, 4.0, 9.5, 25.0])
    fired = []
    telemetry = StepTelemetry(
        limit=2, on_limit=lambda t: fired.append(t.steps), clock=EventClock(device.event)
    )
    x = torch.zeros(4, 3)
    no_comm = lambda: (None, None)
    for _ in range(3):
        telemetry.on_forward((x,), {}, True, no_comm)
    assert fired == [2] and telemetry.records == []  # the device has run nothing yet
    device.run_until(7.0)
    comm = EventClock(device.event)
    span = Span(comm.stamp(), comm.stamp())  # a communication interval of 4 to 9.5 ms
    telemetry.on_forward((x,), {}, True, lambda: (span, None))
    assert [r.step_ms for r in telemetry.records] == [7.0]  # step 1 is read, the rest wait
    device.run_until()
    records = telemetry.to_dict()["records"]
    assert [r["step_ms"] for r in records] == [7.0, 3.0, 15.0]
    assert records[2]["exposed_comm_ms"] == pytest.approx(5.5) and records[2]["samples"] == 4


def _reaches(root, target, limit=20_000) -> bool:
    """Whether `target` is reachable from `root` through the references the garbage collector sees,
    short of modules' globals: every function reaches its module's, and from there torch's process
    group registry, which holds every group (the walk got there once in CI, in a worker that had
    run other tests first)."""
    module_globals = {id(vars(m)) for m in list(sys.modules.values()) if m is not None}
    seen, todo = set(), [root]
    while todo and len(seen) < limit:
        obj = todo.pop()
        if obj is target:
            return True
        if id(obj) in seen or id(obj) in module_globals or isinstance(obj, (type, types.ModuleType)):
            continue
        seen.add(id(obj))
        todo.extend(gc.get_referents(obj))
    return False


def test_torchs_ddp_under_telemetry_leaves_its_group_out_of_the_completion_callback(monkeypatch):
    # gloo destroys a completion callback on its worker thread after running it; had the callback
    # the group's last reference (the script past destroy_process_group), the group's destructor
    # would join that very thread and abort the process (CI, torch 2.14.1, 2026-12-03)
    registered = []
    monkeypatch.setattr(
        nn.parallel.DistributedDataParallel,
        "register_comm_hook",
        lambda self, state, hook: registered.append((state, hook)),
    )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = TorchTelemetryDDP(nn.Linear(3, 1))
        model.register_comm_hook(None, allreduce_hook)
        (state, _), group = registered[0], model.process_group
        assert state[1] is group  # the hook still reduces over this module's group

        callbacks = []

        class _Future:
            def then(self, callback):
                callbacks.append(callback)

        bucket = types.SimpleNamespace(index=lambda: 0, buffer=lambda: torch.zeros(4))
        _timed(lambda _state, _bucket: _Future())(state, bucket)
        assert not _reaches(callbacks[0], group)
        assert _reaches(state, group)  # the check can see the group where it is
    finally:
        dist.destroy_process_group()
