"""Optimizer memory per worker, plain vs sharded (ZeRO stage 1): `python benchmarks/sharded_memory.py`.

Adam on the built-in `transformer` workload, at each world size W twice: plain data parallelism
(dpscale.DistributedDataParallel + torch.optim.Adam, every worker holds all of Adam's state) and
dpscale.optim.ShardedOptimizer(Adam) (each worker holds 1/W of it). Per worker it measures:

- state_bytes: the tensors in optimizer.state, exactly (Adam: two moments per element, a step
  counter per parameter or segment). Target: sharded within 5% of 1/W of plain W=1's.
- peak_rss_bytes: VmHWM from /proc/self/status, the process's peak resident set. It includes
  the interpreter, torch and every shared library, so also
- rss_delta_bytes: that peak minus the resident set just before the model was built (data made
  and torch's lazily imported modules loaded): what the model, its gradients, activations,
  optimizer state and communication buffers added.
- pss_delta_bytes: the same for the proportional set size (/proc/self/smaps_rollup), at the end
  of the run rather than at its peak (the kernel keeps no peak of it). The resident set counts a
  shared-memory page in full in every worker that touches it, and the shm transport's buffers
  are read by every peer; the proportional set divides each page among the workers mapping it,
  so it is the fair per-worker figure here.

Every worker runs the same micro-batch at every W, so activations cost the same everywhere.
Expected per worker, with N the parameter bytes and K the state per parameter byte (Adam: 2):
plain 2N + K N (parameters, gradient buckets, state); sharded 2N + (K + 1) N / W (parameters,
the flat gradient, a 1/W reduce-scatter / all-gather buffer, 1/W of the state).
Flags: --world-sizes 1,2,4, --steps 3, --micro-batch 8, --d-model (a wider transformer, where the
state is a larger part of the memory), --json (one JSON list on the last line).
"""

from __future__ import annotations

import argparse
import json
import platform
from dataclasses import asdict, dataclass

import torch

from dpscale import DistributedDataParallel
from dpscale.lab.multirank import run_ranks
from dpscale.optim import ShardedOptimizer, state_bytes
from dpscale.workloads import get_workload
from dpscale.workloads.models import TinyDecoder

MiB = 1024 * 1024


@dataclass(frozen=True)
class MemoryRow:
    world_size: int
    optimizer: str  # "adam" (plain DDP) or "sharded adam"
    param_bytes: int  # the model's parameters, the same for every row
    state_bytes: int  # per worker; the largest over the workers
    state_fraction: float  # state_bytes / plain W=1's state_bytes
    target_fraction: float  # 1/W for sharded, 1 for plain
    within_target: bool  # state_fraction within 5% of target_fraction
    peak_rss_bytes: int  # largest over the workers
    rss_delta_bytes: int  # largest over the workers
    pss_delta_bytes: int  # largest over the workers


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def _pss_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/smaps_rollup has no Pss")


def _measure(rank: int, world: int, sharded: bool, steps: int, micro_batch: int, d_model: int | None) -> dict:
    workload = get_workload("transformer")
    data, _ = workload.build_data(0)
    # the first optimizer imports torch._dynamo (~100 MiB resident): not what is measured here
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])
    rss_before, pss_before = _status_bytes("VmRSS"), _pss_bytes()
    torch.manual_seed(0)
    model = workload.build_model() if d_model is None else TinyDecoder(d_model=d_model)
    if sharded:
        net, opt = model, ShardedOptimizer(torch.optim.Adam, model.parameters(), lr=1e-3)
    else:
        net = DistributedDataParallel(model)
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for step in range(steps):
        lo = ((step * world + rank) * micro_batch) % (len(data) - micro_batch)
        x, y = data.batch(list(range(lo, lo + micro_batch)))
        opt.zero_grad()
        workload.loss_sum(net(x), y).backward()
        opt.step()
    return {
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "state_bytes": state_bytes(opt),
        "peak_rss_bytes": _status_bytes("VmHWM"),
        "rss_delta_bytes": _status_bytes("VmHWM") - rss_before,
        "pss_delta_bytes": _pss_bytes() - pss_before,
    }


def run(world_sizes: list[int], steps: int, micro_batch: int, d_model: int | None = None) -> list[MemoryRow]:
    measured = {
        (w, sharded): run_ranks(_measure, w, sharded, steps, micro_batch, d_model, timeout_s=600)
        for w in world_sizes
        for sharded in (False, True)
    }
    base_w = min(world_sizes)
    unsharded = max(r["state_bytes"] for r in measured[(base_w, False)])
    rows = []
    for (w, sharded), ranks in measured.items():
        state = max(r["state_bytes"] for r in ranks)
        target = 1 / w if sharded else 1.0
        rows.append(
            MemoryRow(
                world_size=w,
                optimizer="sharded adam" if sharded else "adam",
                param_bytes=ranks[0]["param_bytes"],
                state_bytes=state,
                state_fraction=state / unsharded,
                target_fraction=target,
                within_target=abs(state / unsharded - target) <= 0.05 * target,
                peak_rss_bytes=max(r["peak_rss_bytes"] for r in ranks),
                rss_delta_bytes=max(r["rss_delta_bytes"] for r in ranks),
                pss_delta_bytes=max(r["pss_delta_bytes"] for r in ranks),
            )
        )
    return rows


def format_table(rows: list[MemoryRow]) -> str:
    head = f"{'W':>3} {'optimizer':>13} {'state MiB':>10} {'state/plain':>12} {'target':>8} {'ok':>4}"
    head += f" {'peak RSS MiB':>13} {'RSS delta MiB':>14} {'PSS delta MiB':>14}"
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.world_size:>3} {r.optimizer:>13} {r.state_bytes / MiB:>10.3f} {r.state_fraction:>12.4f} "
            f"{r.target_fraction:>8.4f} {'yes' if r.within_target else 'NO':>4} "
            f"{r.peak_rss_bytes / MiB:>13.1f} {r.rss_delta_bytes / MiB:>14.1f} "
            f"{r.pss_delta_bytes / MiB:>14.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="1,2,4", help="comma-separated (default 1,2,4)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run (default 3)")
    parser.add_argument(
        "--micro-batch", type=int, default=8, help="sequences per worker and step (default 8)"
    )
    parser.add_argument(
        "--d-model",
        type=int,
        default=None,
        help="width of the transformer instead of the workload's 128 (memory effects show at 512)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the rows as one JSON list on the last line"
    )
    args = parser.parse_args(argv)
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    if not world_sizes or min(world_sizes) < 1 or args.steps < 1 or args.micro_batch < 1:
        parser.error("world sizes, --steps and --micro-batch must be positive")
    if args.d_model is not None and (args.d_model < 4 or args.d_model % 4):
        parser.error("--d-model must be a positive multiple of 4 (the model has 4 attention heads)")
    rows = run(world_sizes, args.steps, args.micro_batch, args.d_model)
    print(
        f"Adam on transformer, d_model {args.d_model or 128} ({rows[0].param_bytes / MiB:.2f} MiB of fp32 "
        "parameters), "
        f"{args.steps} steps, micro-batch {args.micro_batch}; torch {torch.__version__}, "
        f"{platform.machine()} CPU"
    )
    print(format_table(rows))
    for r in rows:
        if r.optimizer == "sharded adam":
            to_ideal = r.state_fraction / r.target_fraction
            print(
                f"W={r.world_size}: sharded state per worker is {r.state_fraction:.4f} of the unsharded "
                f"state (ideal {r.target_fraction:.4f}, ratio to ideal {to_ideal:.4f})"
            )
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))
    return 0 if all(r.within_target for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
