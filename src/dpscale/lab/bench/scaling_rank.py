"""What each rank of the scaling bench (and `bench engine`, through it) runs: every engine built
from the same seed, then timed training steps in alternating rounds (bench/rounds.py), with the
comm figures each engine logs for its own steps. scaling.py starts the ranks and turns their
times into figures.
"""

from __future__ import annotations

import sys
import time
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from dpscale.comm.select import host_id
from dpscale.engine.factory import wrap
from dpscale.lab.bench.rounds import fixed_round_sizes, run_rounds
from dpscale.lab.recipe import load_recipe
from dpscale.workloads.task import call_model

# Short rounds: the more often engines alternate, the less a burst of load on a shared machine
# lands on one engine only; 5 steps still amortize the switch between models' caches.
STEPS_PER_ROUND = 5


def _transport_name(model: nn.Module, engine: str) -> str:
    if engine.startswith("dpscale"):
        return getattr(getattr(model, "transport", None), "name", "gloo")
    return dist.get_backend() if engine == "torch" else "none"


def timed_step(
    model: nn.Module, opt: torch.optim.Optimizer, loss_sum, x, y, batch: int | None = None
) -> float:
    """One training step as the benches time it (zero_grad, forward, mean loss, backward, step), in ms.

    `x` may be a tensor, tuple or dict (see Task); `batch` counts its samples (default: x.shape[0])."""
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    (loss_sum(call_model(model, x), y) / (batch or x.shape[0])).backward()
    opt.step()
    return (time.perf_counter() - t0) * 1e3


def torch_ddp_comm_ms(model: nn.Module) -> tuple[float, float] | None:
    """(comm ms, exposed comm ms) of the last backward torch's DDP logged, or None for another model.

    torch fills its logging data at the next forward (with sample rate 1, every one), so after a
    step it describes the step before; over a run that is every step but the last, as steady as
    the one the bench times. comm is when any reduction was in flight, the overlap the part of it
    backward's computation hid (torch measures both on CPU, 2.13)."""
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        return None
    data = model._get_ddp_logging_data()
    if "backward_comm_time" not in data:  # nothing logged yet (the first step)
        return None
    comm = data["backward_comm_time"] / 1e6  # ns
    hidden = data.get("backward_compute_comm_overlap_time", 0) / 1e6
    return comm, max(0.0, comm - hidden)


def split_rounds(per_step: list[float]) -> list[list[float]]:
    """One engine's per-step figures cut into the rounds it ran in (engines alternate per round)."""
    return [per_step[i : i + STEPS_PER_ROUND] for i in range(0, len(per_step), STEPS_PER_ROUND)]


def rank_measure(
    rank: int, world_size: int, spec: str, batch: int, engines: list[str], steps: int, warmup: int, path: list
) -> dict:
    # A user model's module is found through the parent's sys.path (a forkserver child may not have it).
    sys.path.extend(p for p in path if p not in sys.path)
    workload = load_recipe(spec)
    x, y = workload.make_batch(batch, torch.Generator().manual_seed(100 + rank))
    runs = {}
    for e in engines:
        torch.manual_seed(0)  # same initial weights for every engine
        model = wrap(workload.build_model(), e)
        # A small lr keeps weights finite over the run; the update costs the same whatever the lr.
        runs[e] = (model, torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9))

    def step(e: str) -> tuple[float, tuple[float, float] | None]:
        model, opt = runs[e]
        ms = timed_step(model, opt, workload.loss, x, y, batch)
        stats = getattr(model, "last_step_stats", None)
        if stats is not None:
            return ms, (stats.comm_ms, stats.exposed_comm_ms)
        return ms, torch_ddp_comm_ms(model)

    for e in engines:
        if isinstance(runs[e][0], nn.parallel.DistributedDataParallel):
            # torch's logging data then describes every step, not the first 10 and each 100th
            cast(Any, runs[e][0])._set_ddp_runtime_logging_sample_rate(1)
        for _ in range(warmup):
            step(e)
    rounds = run_rounds(engines, step, fixed_round_sizes(steps, STEPS_PER_ROUND))
    times = {e: [ms for rnd in rounds[e] for ms, _ in rnd] for e in engines}
    comm = {e: [c for rnd in rounds[e] for _, c in rnd if c is not None] for e in engines}
    transport = {e: _transport_name(runs[e][0], e) for e in engines}
    return {"times": times, "comm": comm, "transport": transport, "host": host_id()}
