"""`Trainer`: the data-parallel training loop every worker runs.

Per optimizer step each worker takes its k micro-batches of the global batch from the sampler,
accumulates their gradients locally (`no_sync`) and lets the last backward reduce the sum. Losses
are sums over samples divided by the number of samples in the whole global batch, so the reduced
gradient equals the full-batch mean whatever W, k or a short last batch. Decisions that must not
differ between ranks (skip a step, stop, checkpoint) come from collectives or from the step count.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..data.sampler import GlobalBatchSampler, StepBatch
from ..engine import DistributedDataParallel
from ..faults import injected
from ..workloads import get_workload
from .checkpoint import capture_rng_state, load_checkpoint, load_latest, restore_rng_state, save_checkpoint
from .config import TrainConfig
from .metrics import MetricsWriter, Progress, StepMetrics, summary_table
from .optim import build_optimizer, build_scheduler


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

    def to_dict(self) -> dict:
        return asdict(self)


def param_sha256(module: nn.Module) -> str:
    """SHA-256 of all parameters in `named_parameters` order, as raw little-endian bytes."""
    h = hashlib.sha256()
    for _, p in module.named_parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Trainer:
    def __init__(self, config: TrainConfig, *, process_group: dist.ProcessGroup | None = None):
        self.cfg = config
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.micro_batch, self.accumulation_steps = config.resolve_batch(self.world_size)
        self.workload = get_workload(config.workload)
        self.train_data, self.test_data = self.workload.build_data(config.seed)
        torch.manual_seed(config.seed)  # identical initial weights everywhere (rank 0's win anyway)
        module = self.workload.build_model()
        if config.engine == "torch":
            self.model = nn.parallel.DistributedDataParallel(
                module, process_group=process_group, bucket_cap_mb=config.bucket_cap_mb
            )
        else:
            self.model = DistributedDataParallel(
                module,
                process_group=process_group,
                bucket_cap_mb=config.bucket_cap_mb,
                transport=config.transport,
            )
        self.optimizer = build_optimizer(config, self.model.parameters())
        self.scheduler = build_scheduler(config, self.optimizer)
        self.sampler = GlobalBatchSampler(
            len(self.train_data),
            global_batch=config.global_batch,
            world_size=self.world_size,
            rank=self.rank,
            accumulation_steps=self.accumulation_steps,
            seed=config.seed,
            tail=config.tail,
        )
        if config.max_steps is not None:
            self.total_steps = config.max_steps
        else:
            self.total_steps = config.epochs * self.sampler.steps_per_epoch
        # each rank its own stream of randomness for anything stochastic in the user's model
        _seed_all(config.seed * 1000 + self.rank)
        self.step = 0
        self.samples_seen = 0
        self.skipped_steps = 0
        self.last_loss: float | None = None
        self.last_checkpoint: str | None = None
        self.resumed_from: int | None = None
        self._steps_iter = None

    # -- the loop --------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        cfg = self.cfg
        if cfg.resume:
            self._resume()
        lead = self.rank == 0
        metrics = MetricsWriter(cfg.metrics_dir if lead else None, resume=self.resumed_from is not None)
        progress = Progress(self.total_steps, cfg.progress if lead else "none", cfg.log_every)
        if lead and self.resumed_from is not None:
            progress.note(f"resumed from {self.last_checkpoint} at step {self.step}")
        t_start, samples_start = time.perf_counter(), self.samples_seen
        try:
            while self.step < self.total_steps:
                m = self._train_step(self._next_batch())
                if lead:
                    metrics.write(m)
                    progress.update(m)
                    if m.skipped:
                        progress.note(
                            f"step {m.step}: non-finite gradient on at least one rank; "
                            "every rank skipped this step"
                        )
                if cfg.checkpoint_dir and (
                    (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0)
                    or self.step == self.total_steps
                ):
                    self.save_checkpoint()
        finally:
            progress.close()
            metrics.close()
        elapsed = time.perf_counter() - t_start
        result = TrainResult(
            world_size=self.world_size,
            global_batch=cfg.global_batch,
            micro_batch=self.micro_batch,
            accumulation_steps=self.accumulation_steps,
            steps=self.step,
            samples_seen=self.samples_seen,
            final_loss=self.last_loss,
            test_accuracy=self.evaluate(),
            samples_per_s=(self.samples_seen - samples_start) / elapsed if elapsed > 0 else 0.0,
            param_sha256=param_sha256(self._module),
            checkpoint=self.last_checkpoint,
            skipped_steps=self.skipped_steps,
            resumed_from_step=self.resumed_from,
            engine=cfg.engine,
            transport=self.model.transport.name if cfg.engine == "dpscale" else dist.get_backend(self.group),
        )
        if lead and cfg.progress != "none":
            _print_summary(result)
        return result

    def _next_batch(self) -> StepBatch:
        while True:
            if self._steps_iter is None:
                if self.sampler.step_in_epoch >= self.sampler.steps_per_epoch:
                    self.sampler.set_epoch(self.sampler.epoch + 1)
                self._steps_iter = self.sampler.iter_steps()
            batch = next(self._steps_iter, None)
            if batch is not None:
                return batch
            self._steps_iter = None

    def _train_step(self, batch: StepBatch) -> StepMetrics:
        t0 = time.perf_counter()
        model, last = self.model, len(batch.micro_batches) - 1
        loss_sum = torch.zeros((), dtype=torch.float64)
        for j, indices in enumerate(batch.micro_batches):
            if not indices and j < last:
                continue  # nothing to add locally; only the synced backward must always run
            x, y = self.train_data.batch(indices)
            with nullcontext() if j == last else model.no_sync():
                loss = self.workload.loss_sum(model(x), y)
                # the engine averages over ranks, so scale the sum by W: mean over ranks of
                # W * local_sum / global_count is the global-batch mean
                (loss * (self.world_size / batch.global_count)).backward()
            loss_sum += loss.detach().double()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if injected("nan_grad", step=self.step + 1, rank=self.rank):
            grads[0].view(-1)[0] = float("nan")  # after the reduction: only this rank sees it
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        # One small collective gives every rank the global loss and the same skip decision: after
        # averaging a non-finite gradient anywhere is non-finite everywhere, but deciding by a
        # collective keeps ranks in lockstep even if a custom hook were to hide it on some rank.
        flags = torch.stack([loss_sum, torch.tensor(float(not torch.isfinite(norm)), dtype=torch.float64)])
        dist.all_reduce(flags, group=self.group)
        skipped = bool(flags[1] > 0)
        lr = self.optimizer.param_groups[0]["lr"]
        if skipped:
            self.skipped_steps += 1
        else:
            if self.cfg.grad_clip_norm is not None:
                torch.nn.utils.clip_grads_with_norm_(model.parameters(), self.cfg.grad_clip_norm, norm)
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.samples_seen += batch.global_count
        self.last_loss = float(flags[0] / batch.global_count)
        step_s = time.perf_counter() - t0
        stats = getattr(model, "last_step_stats", None)
        return StepMetrics(
            step=self.step,
            samples_seen=self.samples_seen,
            loss=self.last_loss,
            lr=lr,
            grad_norm=float(norm),
            step_ms=step_s * 1e3,
            samples_per_s=batch.global_count / step_s,
            comm_ms=stats.comm_ms if stats else None,
            exposed_comm_ms=stats.exposed_comm_ms if stats else None,
            skipped=skipped,
        )

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Accuracy on the workload's test split (classification workloads), the same on all ranks."""
        if self.test_data is None:
            return None
        module = self._module
        module.eval()
        correct = 0
        for lo in range(0, len(self.test_data), 1024):
            x, y = self.test_data.batch(list(range(lo, min(lo + 1024, len(self.test_data)))))
            correct += int((module(x).argmax(dim=-1) == y).sum())
        module.train()
        return correct / len(self.test_data)

    @property
    def _module(self) -> nn.Module:
        return self.model.module

    # -- checkpoints -----------------------------------------------------------------------
    def save_checkpoint(self) -> str:
        """Collective: every rank sends its RNG state; rank 0 writes; all learn the path."""
        rngs: list = [None] * self.world_size
        dist.all_gather_object(rngs, capture_rng_state(), group=self.group)
        path = [None]
        if self.rank == 0:
            payload = {
                "model": self._module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "sampler": self.sampler.state_dict(),
                "trainer": {
                    "step": self.step,
                    "samples_seen": self.samples_seen,
                    "skipped_steps": self.skipped_steps,
                    "world_size": self.world_size,
                    "global_batch": self.cfg.global_batch,
                    "last_loss": self.last_loss,
                },
                "rng": {"ranks": rngs},
            }
            path = [
                str(
                    save_checkpoint(
                        self.cfg.checkpoint_dir, self.step, payload, keep_last=self.cfg.keep_checkpoints
                    )
                )
            ]
        dist.broadcast_object_list(
            path, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group
        )
        self.last_checkpoint = path[0]
        return path[0]

    def _resume(self) -> None:
        root = Path(self.cfg.checkpoint_dir)
        choice = [None]
        if self.rank == 0:
            loaded = load_latest(root)  # warns about each rejected checkpoint, by path
            choice = [str(loaded.path) if loaded else None]
        dist.broadcast_object_list(
            choice, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group
        )
        if choice[0] is None:
            return  # nothing saved yet: a fresh start
        ckpt = load_checkpoint(choice[0]).payload
        state = ckpt["trainer"]
        if state["global_batch"] != self.cfg.global_batch:
            raise ValueError(
                f"checkpoint {choice[0]} was trained with global_batch {state['global_batch']}, this run "
                f"asks for {self.cfg.global_batch}; use the same global batch to resume"
            )
        self._module.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.sampler.load_state_dict(ckpt["sampler"])
        self.step = state["step"]
        self.samples_seen = state["samples_seen"]
        self.skipped_steps = state["skipped_steps"]
        self.last_loss = state["last_loss"]
        rngs = ckpt["rng"]["ranks"]
        # a restart with another world size: ranks beyond the old world reuse a saved stream
        restore_rng_state(rngs[self.rank % len(rngs)])
        self.resumed_from = self.step
        self.last_checkpoint = choice[0]


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _print_summary(r: TrainResult) -> None:
    rows = [
        (
            "workers x micro-batch x accumulation",
            f"{r.world_size} x {r.micro_batch} x {r.accumulation_steps} = global batch {r.global_batch}",
        ),
        ("steps (skipped)", f"{r.steps} ({r.skipped_steps})"),
        ("samples seen", f"{r.samples_seen:,}"),
        ("final loss", "n/a" if r.final_loss is None or math.isnan(r.final_loss) else f"{r.final_loss:.4f}"),
        ("test accuracy", "n/a" if r.test_accuracy is None else f"{r.test_accuracy:.2%}"),
        ("throughput", f"{r.samples_per_s:,.0f} samples/s"),
        ("engine / transport", f"{r.engine} / {r.transport}"),
        ("last checkpoint", r.checkpoint or "none"),
    ]
    summary_table(rows)
