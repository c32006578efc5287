"""`TrainResult`: what a finished run reports (`dpscale train --json`), and its summary table."""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from dpscale.train.metrics import summary_table


@dataclass
class TrainResult:
    """What `dpscale train --json` prints; the same on every rank."""

    world_size: int
    global_batch: int
    micro_batch: int
    accumulation_steps: int
    steps: int
    samples_seen: int
    final_loss: float | None
    test_accuracy: float | None
    samples_per_s: float
    param_sha256: str
    checkpoint: str | None
    skipped_steps: int
    resumed_from_step: int | None
    engine: str
    transport: str
    eval: dict[str, float] | None = None  # "loss" and each metric, means over the task's eval_data
    # why the run ended before its last step: "diverged", or the signal that asked it to stop
    # ("SIGTERM", "SIGINT"); None when it ran to the end
    stopped_by: str | None = None
    stop_message: str | None = None
    # the run's simple noise scale B_simple in samples, from all its steps
    # (train/adaptive/noise_meter.py); None when not measured (one worker without accumulation,
    # torch's engine with W > 1, turned off)
    gradient_noise_scale: float | None = None
    # with --global-batch auto, the global batch after each change: [(0, start), (steps done, batch),
    # ...] (one pair: the start batch throughout); None with a fixed global batch
    global_batch_schedule: list[tuple[int, int]] | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def param_sha256(module: nn.Module) -> str:
    """SHA-256 of all parameters in `named_parameters` order, as raw little-endian bytes."""
    h = hashlib.sha256()
    for _, p in module.named_parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def print_summary(r: TrainResult) -> None:
    rows = [
        (
            "workers x micro-batch x accumulation",
            f"{r.world_size} x {r.micro_batch} x {r.accumulation_steps} = global batch {r.global_batch}",
        ),
        ("steps (skipped)", f"{r.steps} ({r.skipped_steps})"),
        ("samples seen", f"{r.samples_seen:,}"),
        ("final loss", "n/a" if r.final_loss is None or math.isnan(r.final_loss) else f"{r.final_loss:.4f}"),
        ("test accuracy", "n/a" if r.test_accuracy is None else f"{r.test_accuracy:.2%}"),
        ("eval", ", ".join(f"{k} {v:.4g}" for k, v in r.eval.items()) if r.eval else "n/a"),
        ("throughput", f"{r.samples_per_s:,.0f} samples/s"),
        (
            "gradient noise scale",
            "n/a" if r.gradient_noise_scale is None else f"{r.gradient_noise_scale:,.1f} samples (B_simple)",
        ),
        *([("global batch auto", _schedule(r.global_batch_schedule))] if r.global_batch_schedule else []),
        ("engine / transport", f"{r.engine} / {r.transport}"),
        ("last checkpoint", r.checkpoint or "none"),
    ]
    summary_table(rows)


def _schedule(schedule: list[tuple[int, int]]) -> str:
    """'64 throughout (...)', or '64, 128 after step 20, 64 after step 28'."""
    (_, start), *changes = schedule
    if not changes:
        return f"{start} throughout (the noise scale never made a doubling pay)"
    return ", ".join([str(start), *(f"{batch} after step {step}" for step, batch in changes)])
