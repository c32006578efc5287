"""`Trainer`: the data-parallel training loop every worker runs.

Per optimizer step each worker takes its k micro-batches of the global batch from the sampler,
accumulates their gradients locally (`no_sync`) and lets the last backward reduce the sum. Losses
are sums over samples divided by the number of samples in the whole global batch, so the reduced
gradient equals the full-batch mean whatever W, k or a short last batch. Decisions that must not
differ between ranks (skip a step, stop, checkpoint, check for drift) come from collectives or
from the step count. Every collective is recorded in a `CollectiveLog`; a timed-out one is reported
with the ranks that did not answer and what this rank last issued.

This file builds the trainer and runs the loop (`fit`); one step is step.py's `TrainStep`, saving
and restoring the trainer's state is save_restore.py's `SaveRestore`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from dpscale.data.sampler import GlobalBatchSampler, StepBatch
from dpscale.engine import DistributedDataParallel
from dpscale.engine.collective_log import CollectiveLog, explain_failures
from dpscale.engine.factory import wrap
from dpscale.engine.hooks import compression_hook
from dpscale.engine.noise_scale import NoiseScaleObserver
from dpscale.errors import ConfigError
from dpscale.train.adaptive.adascale import AdaScaleGain
from dpscale.train.adaptive.auto_batch import MAX_GROWTH, GrowBatch
from dpscale.train.adaptive.noise_scale import NoiseScaleMeter
from dpscale.train.batches import MicroBatches
from dpscale.train.callbacks import TrainerCallback, checked
from dpscale.train.checkpoint.resume import plan_total_steps
from dpscale.train.config import TrainConfig
from dpscale.train.device import Precision, resolve_device
from dpscale.train.drift import check_replicas
from dpscale.train.evaluate import evaluate
from dpscale.train.metrics import MetricsWriter, Progress, StepMetrics
from dpscale.train.optim import build_optimizer, build_scheduler
from dpscale.train.result import TrainResult, param_sha256, print_summary
from dpscale.train.save_restore import SaveRestore
from dpscale.train.state import TrainState
from dpscale.train.step import TrainStep
from dpscale.workloads import WORKLOADS
from dpscale.workloads.load import load_task
from dpscale.workloads.task import Task

# How long a rank whose collective failed waits for the others to report theirs: they time out
# at about the same moment, so a few seconds separate "also failed" from "gone".
_REPORT_WAIT_S = 10.0


def resolve_task(config: TrainConfig) -> Task:
    """The config's task: its `task` spec, else its built-in `workload`."""
    if config.task is not None:
        return load_task(config.task, seed=config.seed)
    if config.workload is not None:
        return WORKLOADS[config.workload].task(config.seed)
    raise ConfigError("no task: pass Trainer(config, task), or set config.task or config.workload")


class Trainer(TrainStep, SaveRestore):
    """Trains `task` (default: the one the config names) with data parallelism over `process_group`.

    Every rank constructs a Trainer and calls `fit()`; under torchrun the process group comes from
    `dist.init_process_group` (NCCL with one GPU per worker for `device="cuda"`, else gloo).
    """

    def __init__(
        self,
        config: TrainConfig,
        task: Task | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        callbacks: Sequence[TrainerCallback] = (),
        stop_requested: Callable[[], str | None] | None = None,
    ):
        """`stop_requested()` returns why to stop (e.g. "SIGTERM") or None; it is asked once per step
        and any rank's request stops every rank at the end of that step, after a checkpoint.
        `callbacks` see the loop's points (see callbacks.py)."""
        if task is not None and not isinstance(task, Task):
            raise ConfigError(f"task must be a dpscale.Task, got {type(task).__name__}")
        self.cfg = config
        self.callbacks = checked(callbacks)
        self._stop_requested = stop_requested or (lambda: None)
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        # the configured global batch; with world_change=scale-lr a resume may change it (see
        # resume.py), and the LR follows through the state's `batch_scale`
        global_batch = config.global_batch
        self._split_error: ValueError | None = None
        try:
            micro_batch, accumulation_steps = config.resolve_batch(self.world_size)
        except ValueError as e:
            # scale-lr restarts at a world size the configured batch may not split over; the
            # checkpoint's per-worker batch decides, so wait for it (fit raises if there is none)
            if not (config.resume and config.world_change == "scale-lr"):
                raise
            self._split_error = e
            micro_batch, accumulation_steps = max(1, global_batch // self.world_size), 1
            global_batch = micro_batch * self.world_size
        # the loop's progress: what a checkpoint's trainer.pt holds
        self.state = TrainState(
            world_size=self.world_size,
            global_batch=global_batch,
            base_global_batch=config.global_batch,
            micro_batch=micro_batch,
            accumulation_steps=accumulation_steps,
        )
        self._growth: GrowBatch | None = None
        if config.auto_batch:  # global_batch auto: the batch grows with the noise scale (auto_batch.py)
            if self.world_size == 1 and accumulation_steps < 2:
                raise ConfigError(
                    "global_batch auto on one worker needs accumulation_steps >= 2: the noise scale "
                    "that drives it needs two gradients per step"
                )
            self._growth = GrowBatch(max_global_batch=MAX_GROWTH * global_batch)
            self._growth_start = global_batch
            self.callbacks += [self._growth, AdaScaleGain(base_batch=global_batch)]
        self.task = task if task is not None else resolve_task(config)
        self.train_data = self.task.train_data
        if len(self.train_data) < global_batch and config.tail == "drop":
            raise ConfigError(
                f"train_data has {len(self.train_data)} samples, fewer than one global batch of "
                f"{global_batch}; use a global batch of at most {len(self.train_data)}"
            )
        self.device = resolve_device(config.device)
        self.precision = Precision(config.precision, self.device)
        # what this rank asked of the others: for hang reports and the first steps' agreement check
        self.log = CollectiveLog(process_group)
        torch.manual_seed(config.seed)  # identical initial weights everywhere (rank 0's win anyway)
        module = self.task.model()
        if not isinstance(module, nn.Module):
            raise ConfigError(
                f"Task.model() returned {type(module).__name__}; it must return a torch.nn.Module"
            )
        module.to(self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        with self._explained():
            self.model = wrap(
                module,
                config.engine,
                device_ids=device_ids,
                process_group=process_group,
                bucket_cap_mb=config.bucket_cap_mb,
                transport=config.transport,
                collective_timeout_s=config.collective_timeout_s,
                collective_log=self.log,
            )
        every = config.noise_scale_every
        self.noise_scale = NoiseScaleMeter(self.world_size, enabled=not config.no_noise_scale, every=every)
        if isinstance(self.model, DistributedDataParallel):
            # the step's skip check takes the reduced gradients' norm anyway (train/step.py): the
            # engine need not read them again, unless sparse gradients (outside its buckets) are in
            # it
            reduced_norm = self.model.has_sparse_gradients
            observer = NoiseScaleObserver(every=every, reduced_norm=reduced_norm)
            self.model.set_noise_scale_observer(None if config.no_noise_scale else observer)
        # the hook's state (PowerSGD's Qs and errors) goes into checkpoints; None for stateless hooks
        self.comm_state = None
        if (hook := compression_hook(config.compression, process_group)) is not None:
            self.model.register_comm_hook(*hook)
            self.comm_state = hook[0] if hasattr(hook[0], "state_dict") else None
        if self.task.optimizer is not None:
            self.optimizer = self.task.optimizer(self.model.parameters())
            if not isinstance(self.optimizer, torch.optim.Optimizer):
                raise ConfigError(
                    f"Task.optimizer(params) returned {type(self.optimizer).__name__}; "
                    "it must return a torch.optim.Optimizer"
                )
        else:
            self.optimizer = build_optimizer(config, self.model.parameters())
        self.scheduler = build_scheduler(config, self.optimizer, self.state.batch_scale)
        self.sampler = self._build_sampler()
        self.batches = MicroBatches(
            self.train_data,
            self.task.collate,
            workers=config.data_workers,
            pin_memory=self.device.type == "cuda",
        )
        self.total_steps = self.plan_total_steps()
        # each rank its own stream of randomness for anything stochastic in the user's model
        _seed_all(config.seed * 1000 + self.rank)
        self.skipped_in_a_row = 0  # not checkpointed: a resume gives a diverging run its full allowance
        self.stop_agreed = False  # some rank was asked to stop: every rank stops after this step
        self.stopped_by: str | None = None
        self.stop_message: str | None = None
        self.last_checkpoint: str | None = None
        self.resumed_from: int | None = None
        self._steps_iter = None
        self._steps_run = 0  # by this process, for the first-steps collective check

    def _build_sampler(self) -> GlobalBatchSampler:
        return GlobalBatchSampler(
            len(self.train_data),
            global_batch=self.state.global_batch,
            world_size=self.world_size,
            rank=self.rank,
            accumulation_steps=self.state.accumulation_steps,
            seed=self.cfg.seed,
            tail=self.cfg.tail,
        )

    def set_batch_split(self, micro_batch: int, accumulation_steps: int) -> None:
        """Change the global batch's split over workers and micro-batches (resuming at a new world size).

        The global batch becomes W x micro_batch x accumulation_steps; when that differs from the
        current one (world_change=scale-lr), the sampler goes on from the next unused sample.
        """
        self.state.micro_batch, self.state.accumulation_steps = micro_batch, accumulation_steps
        self.state.global_batch = micro_batch * accumulation_steps * self.world_size
        self.state.batch_changed |= self.state.global_batch != self.state.base_global_batch
        state = self.sampler.state_dict()
        self.sampler = self._build_sampler()
        self.sampler.load_state_dict(state, regroup=True)
        self._steps_iter = None

    def plan_total_steps(self) -> int:
        """The step at which training ends (resume.plan_total_steps on this run's position)."""
        cfg = self.cfg
        return plan_total_steps(self.state, max_steps=cfg.max_steps, epochs=cfg.epochs, sampler=self.sampler)

    @property
    def step(self) -> int:
        """Optimizer steps done (skipped ones included)."""
        return self.state.step

    def _explained(self):
        return explain_failures(self.log, min(self.cfg.collective_timeout_s, _REPORT_WAIT_S))

    # -- the loop --------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        cfg = self.cfg
        if cfg.resume:
            with self._explained():
                self._resume()
        if self._split_error is not None and self.resumed_from is None:
            raise self._split_error  # nothing to resume from: the configured batch must split
        lead = self.rank == 0
        metrics = MetricsWriter(cfg.metrics_dir if lead else None, resumed_from=self.resumed_from)
        progress = Progress(self.total_steps, cfg.progress if lead else "none", cfg.log_every)
        if lead and self.resumed_from is not None:
            progress.note(f"resumed from {self.last_checkpoint} at step {self.step}")
        t_start, samples_start = time.perf_counter(), self.state.samples_seen
        try:
            with self._explained():
                while self.step < self.total_steps:
                    batch = self._next_batch()
                    for c in self.callbacks:
                        c.on_batch(self, batch)
                    self.log.verify = self._steps_run < cfg.check_collectives_steps
                    m = self._train_step(batch)
                    self._steps_run += 1
                    if lead:
                        metrics.write(m)
                        progress.update(m)
                        if m.skipped:
                            progress.note(
                                f"step {m.step}: non-finite gradient on at least one rank; "
                                "every rank skipped this step"
                            )
                    # from the step count, so every rank checks and saves at the same steps
                    if cfg.drift_check_every and self.step % cfg.drift_check_every == 0:
                        check_replicas(self._module, self.group, step=self.step, log=self.log)
                    if cfg.max_skipped_steps and self.skipped_in_a_row >= cfg.max_skipped_steps:
                        self._stop("diverged", self._divergence_message(m))
                        break  # no checkpoint: the last one holds the state before the divergence
                    if cfg.checkpoint_dir and (
                        (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0)
                        or self.step == self.total_steps
                        or self.stop_agreed
                    ):
                        self.save_checkpoint()
                    if self.stop_agreed:
                        self._stop(self._stop_requested() or "signal", self._signal_message())
                        break
                self.log.verify = False
        finally:
            progress.close()
            metrics.close()
            self.batches.close()
            if isinstance(self.model, DistributedDataParallel):
                self.model.close()  # one fit per Trainer: give the hooks and shared memory back now
        elapsed = time.perf_counter() - t_start
        scores = None
        if self.stopped_by is None:  # every rank agrees: a stopped run leaves now (preemption's grace)
            with self._explained():
                scores = self.evaluate()
        result = TrainResult(
            world_size=self.world_size,
            global_batch=self.state.global_batch,
            micro_batch=self.state.micro_batch,
            accumulation_steps=self.state.accumulation_steps,
            steps=self.step,
            samples_seen=self.state.samples_seen,
            final_loss=self.state.last_loss,
            test_accuracy=scores.get("accuracy") if scores else None,
            samples_per_s=(self.state.samples_seen - samples_start) / elapsed if elapsed > 0 else 0.0,
            param_sha256=param_sha256(self._module),
            checkpoint=self.last_checkpoint,
            skipped_steps=self.state.skipped_steps,
            resumed_from_step=self.resumed_from,
            engine=cfg.engine,
            transport=self.model.transport.name if cfg.engine == "dpscale" else dist.get_backend(self.group),
            eval=scores,
            stopped_by=self.stopped_by,
            stop_message=self.stop_message,
            gradient_noise_scale=self.noise_scale.estimator.run_b_simple,
            global_batch_schedule=(
                [(0, self._growth_start), *self._growth.changes] if self._growth else None
            ),
        )
        if lead and cfg.progress != "none":
            print_summary(result)
        return result

    def _next_batch(self) -> StepBatch:
        while True:
            if self._steps_iter is None:
                if self.sampler.step_in_epoch >= self.sampler.steps_this_epoch:
                    self.sampler.set_epoch(self.sampler.epoch + 1)
                self._steps_iter = self.sampler.iter_steps()
                self.batches.start_segment(self.sampler)
            batch = next(self._steps_iter, None)
            if batch is not None:
                return batch
            self._steps_iter = None

    def _stop(self, why: str, message: str) -> None:
        # said once, by whoever started the run (the CLI, or the worker under torchrun)
        self.stopped_by, self.stop_message = why, message

    def _divergence_message(self, m: StepMetrics) -> str:
        first = self.step - self.skipped_in_a_row + 1
        return (
            f"stopped at step {self.step}: steps {first}-{self.step} ({self.skipped_in_a_row} in a row) "
            f"had a non-finite gradient (last loss {m.loss:.4g}, lr {m.lr:.3g}); the run diverged: "
            "lower --lr, set --grad-clip-norm, or raise --max-skipped-steps"
        )

    def _signal_message(self) -> str:
        why = self._stop_requested() or "a signal to another rank"
        saved = (
            f"; checkpoint {self.last_checkpoint}, continue with --resume" if self.cfg.checkpoint_dir else ""
        )
        return f"stopped by {why} after step {self.step}{saved}"

    def evaluate(self) -> dict[str, float] | None:
        """The loss and the task's metrics averaged over its eval_data, the same on all ranks (collective)."""
        return evaluate(
            self.task,
            self._module,
            batch_size=max(self.state.micro_batch, 256),
            device=self.device,
            autocast=self.precision.autocast,
            group=self.group,
            log=self.log,
        )

    @property
    def _module(self) -> nn.Module:
        return self.model.module


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
