"""`Trainer`: the data-parallel training loop every worker runs.

Per optimizer step each worker takes its k micro-batches of the global batch from the sampler,
accumulates their gradients locally (`no_sync`) and lets the last backward reduce the sum. Losses
are sums over samples divided by the number of samples in the whole global batch, so the reduced
gradient equals the full-batch mean whatever W, k or a short last batch. Decisions that must not
differ between ranks (skip a step, stop, checkpoint, check for drift) come from collectives or
from the step count. Every collective is recorded in a `CollectiveLog`; a timed-out one is reported
with the ranks that did not answer and what this rank last issued.

The class reads in the loop's order: building the parts, `fit`'s loop, one step, the result, and
checkpoints. Its components: `StepFlags` (step_flags.py) is the per-step collective and the counts
decided from it, `TrainStates` (checkpoint/train_states.py) the named states a checkpoint holds,
`TrainState` (state.py) the loop's progress.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from dpscale.data.sampler import GlobalBatchSampler, StepBatch
from dpscale.engine import DistributedDataParallel
from dpscale.engine.clock import clock_for
from dpscale.engine.collective_log import CollectiveLog, explain_failures
from dpscale.engine.factory import wrap
from dpscale.engine.hooks import compression_hook
from dpscale.engine.noise_scale import NoiseScaleObserver
from dpscale.engine.observers import GradNormTensors
from dpscale.engine.profiler_ranges import DATA_WAIT, OPTIMIZER, profiler_enabled, record_function
from dpscale.errors import ConfigError
from dpscale.log import get_logger
from dpscale.train.adaptive.adascale import AdaScaleGain
from dpscale.train.adaptive.auto_batch import MAX_GROWTH, GrowBatch
from dpscale.train.adaptive.noise_meter import NoiseScaleMeter, grad_sq_norm
from dpscale.train.batches import MicroBatches
from dpscale.train.callbacks import TrainerCallback, checked
from dpscale.train.checkpoint.checkpointer import load_into
from dpscale.train.checkpoint.resume import (
    BatchSplit,
    check_resumable,
    describe_resplit,
    plan_split,
    plan_total_steps,
)
from dpscale.train.checkpoint.train_states import TrainStates
from dpscale.train.config import TrainConfig
from dpscale.train.device import Precision, resolve_device
from dpscale.train.drift import check_replicas
from dpscale.train.evaluate import evaluate
from dpscale.train.metrics import MetricsWriter, Progress, StepMetrics
from dpscale.train.optim import build_optimizer, build_scheduler, sync_lr
from dpscale.train.result import TrainResult, param_sha256, print_summary
from dpscale.train.state import TrainState
from dpscale.train.step_flags import StepFlags
from dpscale.train.step_trace import StepTrace
from dpscale.workloads import WORKLOADS
from dpscale.workloads.load import load_task
from dpscale.workloads.task import Task, call_model, num_samples, per_sample, to_device

if TYPE_CHECKING:
    # torch.distributed.checkpoint costs ~1 s of import time in every process (workers, the CLI):
    # the protocol is only an annotation here
    from torch.distributed.checkpoint.stateful import Stateful

logger = get_logger(__name__)

# what `wrap` returns for the train engines ("dpscale", "torch")
Wrapped = DistributedDataParallel | nn.parallel.DistributedDataParallel

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


class Trainer:
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
        trusted_checkpoint: dict | None = None,
    ):
        """`stop_requested()` returns why to stop (e.g. "SIGTERM") or None; it is asked once per step
        and any rank's request stops every rank at the end of that step, after a checkpoint.
        `callbacks` see the loop's points (see callbacks.py). `trusted_checkpoint`: the checkpoint
        the launcher verified before starting (files.load_latest's `verified`), not hashed again."""
        if task is not None and not isinstance(task, Task):
            raise ConfigError(f"task must be a dpscale.Task, got {type(task).__name__}")
        self.cfg = config
        self.callbacks = checked(callbacks)
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        # the loop's progress: what a checkpoint's trainer.pt holds
        self.state = self._initial_state()
        self._growth = self._batch_growth()
        self.task = task if task is not None else resolve_task(config)
        self.train_data = self.task.train_data
        self.num_samples = num_samples(self.train_data)
        if self.num_samples < self.state.global_batch and config.data.tail == "drop":
            raise ConfigError(
                f"train_data has {self.num_samples} samples, fewer than one global batch of "
                f"{self.state.global_batch}; use a global batch of at most {self.num_samples}"
            )
        self.device = resolve_device(config.device)
        # the one clock for the loop's timings (engine/clock.py): events on CUDA, read lazily
        self.clock = clock_for(self.device)
        self.precision = Precision(config.precision, self.device)
        # what this rank asked of the others: for hang reports and the first steps' agreement check
        self.log = CollectiveLog(process_group)
        self.model = self._wrapped_model()
        every = config.adaptive.noise_scale_every
        self.noise_scale = NoiseScaleMeter(
            self.world_size, enabled=not config.adaptive.no_noise_scale, every=every
        )
        # dpscale's engine measures this rank's gradient norm for the noise scale (W > 1)
        self._engine_noise: NoiseScaleObserver | None = None
        if isinstance(self.model, DistributedDataParallel):
            # the step's skip check takes the reduced gradients' norm anyway (`_train_step` below): the
            # engine need not read them again, unless sparse gradients (outside its buckets) are in
            # it
            reduced_norm = self.model.has_sparse_gradients
            observer = NoiseScaleObserver(every=every, reduced_norm=reduced_norm)
            self._engine_noise = None if config.adaptive.no_noise_scale else observer
            self.model.set_noise_scale_observer(self._engine_noise)
        # the hook's state (PowerSGD's Qs and errors) goes into checkpoints; None for stateless hooks
        self.comm_state = None
        if (hook := compression_hook(config.engine.compression, process_group)) is not None:
            self.model.register_comm_hook(*hook)
            self.comm_state = hook[0] if hasattr(hook[0], "state_dict") else None
        self.optimizer = self._build_optimizer()
        self.scheduler = build_scheduler(config, self.optimizer, self.state.batch_scale)
        self.sampler = self._build_sampler()
        self.batches = MicroBatches(
            self.train_data,
            self.task.collate,
            workers=config.data.data_workers,
            pin_memory=self.device.type == "cuda",
            device=self.device if self.device.type == "cuda" else None,
        )
        self.total_steps = self.plan_total_steps()
        # each rank its own stream of randomness for anything stochastic in the user's model
        _seed_all(config.seed * 1000 + self.rank)
        self.flags = StepFlags(
            group=process_group, world_size=self.world_size, log=self.log, stop_requested=stop_requested
        )
        self.states = TrainStates(
            module=self._module,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            state=self.state,
            precision=self.precision,
            noise_scale=self.noise_scale,
            growth=self._growth,
            comm_state=self.comm_state,
            compression=config.engine.compression,
            group=process_group,
            log=self.log,
            callbacks=self.callbacks,
            directory=config.checkpoint.dir,
            keep_last=config.checkpoint.keep,
            run_id=config.checkpoint.run_id,
        )
        self._trusted_checkpoint = trusted_checkpoint
        self.stopped_by: str | None = None
        self.stop_message: str | None = None
        self.last_checkpoint: str | None = None
        self.resumed_from: int | None = None
        self._steps_iter: Iterator[StepBatch] | None = None
        self._replay_rng: dict | None = None  # a resumed checkpoint's pending prefetch (batches.py)
        self._steps_run = 0  # by this process, for the first-steps collective check
        # --trace: the window's steps marked for a Chrome trace (step_trace.py); None: no marks
        window = config.metrics.window
        self._trace = (
            None
            if window is None
            else StepTrace(window, lambda: getattr(self.model, "last_step_stats", None))
        )

    # -- building ------------------------------------------------------------------------
    def _initial_state(self) -> TrainState:
        """The progress of a fresh run, with the configured global batch split over this world."""
        cfg = self.cfg
        assert cfg.data.global_batch is not None, "TrainConfig fills global_batch in"
        # the configured global batch; with world_change=scale-lr a resume may change it (see
        # resume.py), and the LR follows through the state's `batch_scale`
        global_batch = cfg.data.global_batch
        self._split_error: ValueError | None = None
        try:
            micro_batch, accumulation_steps = cfg.resolve_batch(self.world_size)
        except ValueError as e:
            # scale-lr restarts at a world size the configured batch may not split over; the
            # checkpoint's per-worker batch decides, so wait for it (fit raises if there is none)
            if not (cfg.checkpoint.resume and cfg.checkpoint.world_change == "scale-lr"):
                raise
            self._split_error = e
            micro_batch, accumulation_steps = max(1, global_batch // self.world_size), 1
            global_batch = micro_batch * self.world_size
        return TrainState(
            world_size=self.world_size,
            global_batch=global_batch,
            base_global_batch=cfg.data.global_batch,
            micro_batch=micro_batch,
            accumulation_steps=accumulation_steps,
        )

    def _batch_growth(self) -> GrowBatch | None:
        """global_batch auto: the batch grows with the noise scale (auto_batch.py), the LR with
        AdaScale's gain; None for a fixed batch."""
        if not self.cfg.adaptive.auto_batch:
            return None
        if self.world_size == 1 and self._accumulation_steps < 2:
            raise ConfigError(
                "global_batch auto on one worker needs accumulation_steps >= 2: the noise scale "
                "that drives it needs two gradients per step"
            )
        global_batch = self.state.global_batch
        growth = GrowBatch(max_global_batch=MAX_GROWTH * global_batch)
        self._growth_start = global_batch
        self.callbacks += [growth, AdaScaleGain(base_batch=global_batch)]
        return growth

    def _wrapped_model(self) -> Wrapped:
        """The task's model on this device, the same initial weights on every rank, wrapped by the engine."""
        cfg = self.cfg
        torch.manual_seed(cfg.seed)  # identical initial weights everywhere (rank 0's win anyway)
        module = self.task.model()
        if not isinstance(module, nn.Module):
            raise ConfigError(
                f"Task.model() returned {type(module).__name__}; it must return a torch.nn.Module"
            )
        module.to(self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        with self._explained():
            model = wrap(
                module,
                cfg.engine.name,
                device_ids=device_ids,
                process_group=self.group,
                bucket_cap_mb=cfg.engine.bucket_cap_mb,
                transport=cfg.engine.transport,
                collective_timeout_s=cfg.engine.collective_timeout_s,
                collective_log=self.log,
            )
        assert isinstance(model, Wrapped), "TRAIN_ENGINES are dpscale's and torch's DDP"
        return model

    def _build_optimizer(self) -> torch.optim.Optimizer:
        """The task's own optimizer if it has one, else the configured one."""
        if self.task.optimizer is None:
            return build_optimizer(self.cfg, self.model.parameters())
        optimizer = self.task.optimizer(self.model.parameters())
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"Task.optimizer(params) returned {type(optimizer).__name__}; "
                "it must return a torch.optim.Optimizer"
            )
        return optimizer

    def _build_sampler(self) -> GlobalBatchSampler:
        return GlobalBatchSampler(
            self.num_samples,
            global_batch=self.state.global_batch,
            world_size=self.world_size,
            rank=self.rank,
            accumulation_steps=self._accumulation_steps,
            seed=self.cfg.seed,
            tail=self.cfg.data.tail,
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

    @property
    def _accumulation_steps(self) -> int:
        assert self.state.accumulation_steps is not None, "set from the config, or by set_batch_split"
        return self.state.accumulation_steps

    @property
    def _module(self) -> nn.Module:
        module = self.model.module
        assert isinstance(module, nn.Module)
        return module

    def _explained(self) -> AbstractContextManager[None]:
        return explain_failures(self.log, min(self.cfg.engine.collective_timeout_s, _REPORT_WAIT_S))

    # -- the loop --------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        """Train to the end (or a stop), evaluate, and return what the run did; collective."""
        if self.cfg.checkpoint.resume:
            with self._explained():
                self._resume()
        if self._split_error is not None and self.resumed_from is None:
            raise self._split_error  # nothing to resume from: the configured batch must split
        lead = self.rank == 0
        metrics = MetricsWriter(self.cfg.metrics.dir if lead else None, resumed_from=self.resumed_from)
        progress = Progress(
            self.total_steps, self.cfg.metrics.progress if lead else "none", self.cfg.metrics.log_every
        )
        if lead and self.resumed_from is not None:
            progress.note(f"resumed from {self.last_checkpoint} at step {self.step}")
        if self._trace is not None:  # traced steps are numbered as metrics.jsonl's, a resumed run's too
            self._trace.telemetry.steps = self.state.step
        t_start, samples_start = time.perf_counter(), self.state.samples_seen
        try:
            with self._explained():
                self._train_until_done(metrics if lead else None, progress)
        finally:
            progress.close()
            metrics.close()
            self.batches.close()
            if isinstance(self.model, DistributedDataParallel):
                self.model.close()  # one fit per Trainer: give the hooks and shared memory back now
        elapsed = time.perf_counter() - t_start
        if self._trace is not None and self.cfg.metrics.trace is not None:
            with self._explained():  # collective: every rank's traced step times, for the idle lane
                self._trace.write(self.cfg.metrics.trace, self.group, self._transport_name())
        scores = None
        if self.stopped_by is None:  # every rank agrees: a stopped run leaves now (preemption's grace)
            with self._explained():
                scores = self.evaluate()
        samples_per_s = (self.state.samples_seen - samples_start) / elapsed if elapsed > 0 else 0.0
        result = self._result(scores, samples_per_s)
        if lead:  # progress "none" hides the bar, not what the run did
            print_summary(result)
        return result

    def _train_until_done(self, metrics: MetricsWriter | None, progress: Progress) -> None:
        """Steps until the planned last one, a divergence or an agreed stop; `metrics` on rank 0 only."""
        while self.step < self.total_steps:
            with _profiled(DATA_WAIT):
                batch = self._next_batch()
            for c in self.callbacks:
                c.on_batch(self, batch)
            self.log.verify = self._steps_run < self.cfg.engine.check_collectives_steps
            m = self._train_step(batch)
            self._steps_run += 1
            if metrics is not None:
                self._report(m, metrics, progress)
            if self._after_step(m):
                break
        self.log.verify = False

    def _report(self, m: StepMetrics, metrics: MetricsWriter, progress: Progress) -> None:
        metrics.write(m)
        progress.update(m)
        if m.skipped:
            progress.note(
                f"step {m.step}: non-finite gradient on at least one rank; every rank skipped this step"
            )

    def _after_step(self, m: StepMetrics) -> bool:
        """The step's checks, checkpoint and stop, the same on every rank; True: the loop ends."""
        cfg = self.cfg
        # from the step count, so every rank checks and saves at the same steps
        if cfg.engine.drift_check_every and self.step % cfg.engine.drift_check_every == 0:
            check_replicas(self._module, self.group, step=self.step, log=self.log)
        if cfg.optim.max_skipped_steps and self.flags.skipped_in_a_row >= cfg.optim.max_skipped_steps:
            self._stop("diverged", self._divergence_message(m))
            return True  # no checkpoint: the last one holds the state before the divergence
        if cfg.checkpoint.dir and (
            (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0)
            or self.step == self.total_steps
            or self.flags.stop_agreed
        ):
            self.save_checkpoint()
        if self.flags.stop_agreed:
            self._stop(self.flags.stop_requested() or "signal", self._signal_message())
            return True
        return False

    def _next_batch(self) -> StepBatch:
        while True:
            if self._steps_iter is None:
                if self.sampler.step_in_epoch >= self.sampler.steps_this_epoch:
                    self.sampler.set_epoch(self.sampler.epoch + 1)
                self._steps_iter = self.sampler.iter_steps()
                self.batches.start_segment(self.sampler, replay_rng=self._replay_rng)
                self._replay_rng = None
            batch = next(self._steps_iter, None)
            if batch is not None:
                return batch
            self._steps_iter = None

    # -- one step ----------------------------------------------------------------------------
    def _train_step(self, batch: StepBatch) -> StepMetrics:
        """One optimizer step: the micro-batches' forward and backward (the last one synced), the
        flags collective, then the update (or a skip) and the scheduler."""
        t0 = time.perf_counter()
        loss_sum, micro_sq, micro_count = self._forward_backward(batch)
        if self.step + 1 < self.total_steps:
            # the device still runs this step: load the next one meanwhile (the sampler's
            # position, what checkpoints save, does not count it; see batches.py)
            self.batches.prefetch(len(batch.micro_batches))
        noise = self.noise_scale.step_norms(
            engine_norms=self._engine_norms(),
            micro_sq=micro_sq,
            micro_count=micro_count,
            global_count=batch.global_count,
            params=self.model.parameters(),
            loss_scale=self.precision.loss_scale(),
        )
        self.precision.unscale(self.optimizer)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        for c in self.callbacks:
            c.after_reduce(self, grads)
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.device)
        big_sq = [] if noise is None or noise.big_sq is None else [noise.big_sq]
        # the step's one host sync: the flags, the norm and the noise scale's norms in one read
        decision = self.flags.reduce(
            loss_sum, norm, noise.small_sq if noise is not None else None, read_along=big_sq
        )
        if noise is not None:
            # the norm just taken for the skip check is the big-batch norm: no second read
            big = decision.read_along[0] if big_sq else None
            self.noise_scale.update(noise, decision.small_sq, reduced_sq=decision.grad_norm**2, big_sq=big)
        lr = self.optimizer.param_groups[0]["lr"]
        with _profiled(OPTIMIZER):
            self._update(decision.skipped, norm)
        if self._trace is not None:
            self._trace.optimizer_done()
        state = self.state
        state.step += 1
        state.samples_seen += batch.global_count
        state.last_loss = decision.loss_sum / batch.global_count
        for c in self.callbacks:
            c.after_step(self)
        step_s = time.perf_counter() - t0
        stats = getattr(self.model, "last_step_stats", None)
        return StepMetrics(
            step=state.step,
            samples_seen=state.samples_seen,
            loss=state.last_loss,
            lr=lr,
            grad_norm=decision.grad_norm,
            step_ms=step_s * 1e3,
            samples_per_s=batch.global_count / step_s,
            comm_ms=stats.comm_ms if stats else None,
            exposed_comm_ms=stats.exposed_comm_ms if stats else None,
            skipped=decision.skipped,
            gns=self.noise_scale.b_simple,
        )

    def _engine_norms(self) -> GradNormTensors | None:
        """This step's local gradient norms from dpscale's engine (still on the device), None on
        a step it did not measure."""
        observer = self._engine_noise
        return None if observer is None else observer.device_norms(self.step + 1)

    def _forward_backward(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """Accumulate the step's micro-batches under `no_sync`; the last backward is the synced one.

        Returns this rank's loss sum and, when the noise scale wants it (one worker accumulating),
        the first micro-batch's squared gradient norm and sample count."""
        model, last = self.model, len(batch.micro_batches) - 1
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        with _profiled(DATA_WAIT):
            loaded = self.batches.take(len(batch.micro_batches))
        micro_sq, micro_count = None, 0  # the first micro-batch's gradient (one worker, accumulation)
        take_micro = self.noise_scale.wants_micro_norm(len(batch.micro_batches), self.step)
        for j, (indices, (x, y)) in enumerate(zip(batch.micro_batches, loaded, strict=True)):
            if not indices and j < last:
                continue  # nothing to add locally; only the synced backward must always run
            x, y = to_device((x, y), self.device, non_blocking=True)
            trace = self._trace
            if trace is not None:
                trace.forward_begins(x, synced=j == last)
            with nullcontext() if j == last else model.no_sync():
                with self.precision.autocast():
                    out = call_model(model, x)
                    if trace is not None:
                        trace.forward_ends(synced=j == last)
                    losses = per_sample("Task.loss", self.task.per_sample_loss(out, y), max(1, len(indices)))
                # an empty micro-batch was loaded as one sample (see batches.py): weight it zero
                loss = losses.float().sum() * (1.0 if indices else 0.0)
                # the engine averages over ranks, so scale the sum by W: mean over ranks of
                # W * local_sum / global_count is the global-batch mean
                b0 = time.perf_counter() if trace is not None else 0.0
                self.precision.scale(loss * (self.world_size / batch.global_count)).backward()
                if trace is not None:
                    trace.backward(b0, time.perf_counter())
            loss_sum += loss.detach().double()
            if take_micro and micro_sq is None and indices:
                micro_sq, micro_count = grad_sq_norm(model.parameters()), len(indices)
        return loss_sum, micro_sq, micro_count

    def _update(self, skipped: bool, norm: torch.Tensor) -> None:
        """The optimizer and scheduler step, or a skipped step's count; gradients cleared either way."""
        if skipped:
            self.state.skipped_steps += 1
        elif self.cfg.optim.grad_clip_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), self.cfg.optim.grad_clip_norm, norm)
        self.precision.step(self.optimizer, skipped)
        if not skipped:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    # -- stopping and the result ------------------------------------------------------------------
    def _stop(self, why: str, message: str) -> None:
        # said once, by whoever started the run (the CLI, or the worker under torchrun)
        self.stopped_by, self.stop_message = why, message

    def _divergence_message(self, m: StepMetrics) -> str:
        in_a_row = self.flags.skipped_in_a_row
        first = self.step - in_a_row + 1
        return (
            f"stopped at step {self.step}: steps {first}-{self.step} ({in_a_row} in a row) "
            f"had a non-finite gradient (last loss {m.loss:.4g}, lr {m.lr:.3g}); the run diverged: "
            "lower --lr, set --grad-clip-norm, or raise --max-skipped-steps"
        )

    def _signal_message(self) -> str:
        why = self.flags.stop_requested() or "a signal to another rank"
        saved = (
            f"; checkpoint {self.last_checkpoint}, continue with --resume" if self.cfg.checkpoint.dir else ""
        )
        return f"stopped by {why} after step {self.step}{saved}"

    def evaluate(self) -> dict[str, float] | None:
        """The loss and the task's metrics averaged over its eval_data, the same on all ranks (collective)."""
        return evaluate(
            self.task,
            self._module,
            batch_size=max(self._micro_batch, 256),
            device=self.device,
            autocast=self.precision.autocast,
            group=self.group,
            log=self.log,
        )

    def _transport_name(self) -> str:
        if isinstance(self.model, DistributedDataParallel):
            engine_transport = self.model.transport
            assert not isinstance(engine_transport, str), "the engine resolves its transport when built"
            return engine_transport.name
        return dist.get_backend(self.group)

    def _result(self, scores: dict[str, float] | None, samples_per_s: float) -> TrainResult:
        cfg, state = self.cfg, self.state
        transport = self._transport_name()
        return TrainResult(
            world_size=self.world_size,
            global_batch=state.global_batch,
            micro_batch=self._micro_batch,
            accumulation_steps=self._accumulation_steps,
            steps=self.step,
            samples_seen=state.samples_seen,
            final_loss=state.last_loss,
            test_accuracy=scores.get("accuracy") if scores else None,
            samples_per_s=samples_per_s,
            param_sha256=param_sha256(self._module),
            checkpoint=self.last_checkpoint,
            skipped_steps=state.skipped_steps,
            resumed_from_step=self.resumed_from,
            engine=cfg.engine.name,
            transport=transport,
            eval=scores,
            stopped_by=self.stopped_by,
            stop_message=self.stop_message,
            gradient_noise_scale=self.noise_scale.estimator.run_b_simple,
            global_batch_schedule=(
                [(0, self._growth_start), *self._growth.changes] if self._growth else None
            ),
        )

    # -- checkpoints ---------------------------------------------------------------------------
    def stateful(self) -> dict[str, Stateful]:
        """The named objects a checkpoint saves from rank 0, each with state_dict/load_state_dict."""
        return self.states.shared(self.sampler)

    def state_dict(self) -> dict:
        return {name: obj.state_dict() for name, obj in self.stateful().items()}

    def save_checkpoint(self) -> str:
        """Collective: rank 0 writes this step's checkpoint; all learn the path."""
        # a resume loads the prefetched step again, under the RNGs it was loaded under here; a
        # prefetch of a segment already ended (a re-split) is dropped unused, also by a resume
        pending = self.batches.pending_rng() if self._steps_iter is not None else None
        self.last_checkpoint = self.states.save(self.sampler, rng_before_prefetch=pending)
        return self.last_checkpoint

    def _resume(self) -> None:
        """Collective: continue from the newest checkpoint that verifies; a fresh start if there is none."""
        saved: list[TrainState] = []
        path = self.states.resume(
            lambda ckpt: saved.append(self.load_state_dict(ckpt.payload, ckpt.path)), self._trusted_checkpoint
        )
        if path is None:
            return
        self.resumed_from, self.last_checkpoint = self.step, path
        if self.rank == 0 and saved[0].world_size != self.world_size:
            old, s = saved[0], self.scheduler
            logger.info(
                "%s",
                describe_resplit(
                    old, self.state, self.cfg, s.last_epoch, float(s.base_lrs[0]), self.total_steps
                ),
            )

    def load_state_dict(self, payload: dict, where: Path | str = "checkpoint") -> TrainState:
        """Continue from a checkpoint's states (`TrainStates`' names), also at another world size
        (resume.py's plan); returns the saved TrainState."""
        cfg, where = self.cfg, Path(where)
        saved = TrainState.from_state_dict(payload["trainer"], where / "trainer.pt")
        auto = self._growth is not None
        check_resumable(
            saved,
            global_batch=self.state.base_global_batch,
            world_change=cfg.checkpoint.world_change,
            where=where,
            auto_batch=auto,
        )
        self.states.load_progress(payload, saved, where)
        if isinstance(self.model, DistributedDataParallel):  # one synced backward per step
            self.model.set_synced_steps(saved.step)
        self._resplit(saved, payload["sampler"], where)
        sync_lr(self.scheduler)
        self.total_steps = self.plan_total_steps()
        self._replay_rng = self.states.load_per_rank(payload, where)
        return saved

    def _resplit(self, saved: TrainState, sampler_state: object, where: Path) -> None:
        """Fit the saved run to this world size (resume.py's plan), then load the sampler's position."""
        cfg, state = self.cfg, self.state
        auto = self._growth is not None
        current = BatchSplit(self._micro_batch, self._accumulation_steps)
        split = plan_split(
            saved,
            world_size=self.world_size,
            current=current,
            global_batch=state.global_batch,
            configured_global_batch=state.base_global_batch,
            world_change=cfg.checkpoint.world_change,
            split_given=cfg.data.micro_batch is not None or cfg.data.accumulation_steps is not None,
            where=where / "trainer.pt",
            auto_batch=auto,
        )
        if split != current:
            self.set_batch_split(split.micro_batch, split.accumulation_steps)
        regroup = state.global_batch != saved.global_batch
        if self._growth is not None:
            growth = self._growth
            load_into(
                lambda s: growth.load_state_dict(s, same_world=saved.world_size == self.world_size),
                saved.batch_growth or {"changes": [], "fastest_s": {}},  # a fixed-batch run's: starts growing
                where / "trainer.pt",
            )
            if regroup:  # the grown batch does not split over this world size: back to the start
                growth.changes.append((saved.step, state.global_batch))
        load_into(
            lambda s: self.sampler.load_state_dict(s, regroup=regroup), sampler_state, where / "sampler.pt"
        )
        if regroup and not auto:  # scale-lr's linear rule; a growing batch's rate is AdaScale's
            state.batch_scale.retarget(
                state.global_batch / state.base_global_batch,
                self.scheduler.last_epoch,
                cfg.checkpoint.rescale_warmup_steps,
            )

    @property
    def _micro_batch(self) -> int:
        assert self.state.micro_batch is not None, "set from the config, or by set_batch_split"
        return self.state.micro_batch


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _profiled(name: str) -> AbstractContextManager:
    """A range `name` in the torch.profiler the caller runs, if one records (else nothing)."""
    return record_function(name) if profiler_enabled() else nullcontext()
