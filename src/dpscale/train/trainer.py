"""`Trainer`: the data-parallel training loop every worker runs.

Per optimizer step each worker takes its k micro-batches of the global batch from the sampler,
accumulates their gradients locally (`no_sync`) and lets the last backward reduce the sum. Losses
are sums over samples divided by the number of samples in the whole global batch, so the reduced
gradient equals the full-batch mean whatever W, k or a short last batch. Decisions that must not
differ between ranks (skip a step, stop, checkpoint, check for drift) come from collectives or
from the step count. Every collective is recorded in a `CollectiveLog`; a timed-out one is reported
with the ranks that did not answer and what this rank last issued.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..data.sampler import GlobalBatchSampler, StepBatch
from ..engine import DistributedDataParallel
from ..engine.collective_log import CollectiveLog, explain_failures
from ..engine.hooks import compression_hook
from ..engine.registry import wrap
from ..errors import ConfigError
from ..workloads import WORKLOADS
from ..workloads.load import load_task
from ..workloads.task import Task, call_model, per_sample, to_device
from .batches import MicroBatches
from .callbacks import TrainerCallback, checked
from .checkpoint import CheckpointError
from .checkpointer import Checkpointer, Stateful, load_into
from .config import TrainConfig
from .device import Precision, resolve_device
from .drift import check_replicas
from .evaluate import evaluate
from .metrics import MetricsWriter, Progress, StepMetrics
from .noise_scale import NoiseScaleMeter, grad_sq_norm
from .optim import build_optimizer, build_scheduler, sync_lr
from .rank_state import HookState, RngState
from .result import TrainResult, param_sha256, print_summary
from .resume import BatchSplit, check_resumable, describe_resplit, plan_split, plan_total_steps
from .state import TrainState

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
            self.model.reducer.measure_noise_scale = not config.no_noise_scale
            self.model.reducer.noise_scale_every = every
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
        metrics = MetricsWriter(cfg.metrics_dir if lead else None, resume=self.resumed_from is not None)
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

    def _train_step(self, batch: StepBatch) -> StepMetrics:
        t0 = time.perf_counter()
        model, last = self.model, len(batch.micro_batches) - 1
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        loaded = self.batches.take(len(batch.micro_batches))
        micro_sq, micro_count = None, 0  # the first micro-batch's gradient (one worker, accumulation)
        take_micro = self.noise_scale.wants_micro_norm(len(batch.micro_batches), self.step)
        for j, (indices, (x, y)) in enumerate(zip(batch.micro_batches, loaded, strict=True)):
            if not indices and j < last:
                continue  # nothing to add locally; only the synced backward must always run
            x, y = to_device((x, y), self.device, non_blocking=True)
            with nullcontext() if j == last else model.no_sync():
                with self.precision.autocast():
                    out = call_model(model, x)
                    losses = per_sample("Task.loss", self.task.loss(out, y), max(1, len(indices)))
                # an empty micro-batch was loaded as one sample (see batches.py): weight it zero
                loss = losses.float().sum() * (1.0 if indices else 0.0)
                # the engine averages over ranks, so scale the sum by W: mean over ranks of
                # W * local_sum / global_count is the global-batch mean
                self.precision.scale(loss * (self.world_size / batch.global_count)).backward()
            loss_sum += loss.detach().double()
            if take_micro and micro_sq is None and indices:
                micro_sq, micro_count = grad_sq_norm(model.parameters()), len(indices)
        noise = self.noise_scale.step_norms(
            engine_stats=getattr(model, "last_step_stats", None),
            micro_sq=micro_sq,
            micro_count=micro_count,
            global_count=batch.global_count,
            params=model.parameters(),
        )
        self.precision.unscale(self.optimizer)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        for c in self.callbacks:
            c.after_reduce(self, grads)
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.device)
        # One small collective gives every rank the global loss and the same skip decision: after
        # averaging a non-finite gradient anywhere is non-finite everywhere, but deciding by a
        # collective keeps ranks in lockstep even if a custom hook were to hide it on some rank.
        # The same collective carries a stop request (a signal that reached any rank), so every rank
        # stops after the same step.
        stop = loss_sum.new_tensor(float(self._stop_requested() is not None))
        # ... and the local squared gradient norm for the noise scale, averaged over ranks
        small_sq = loss_sum.new_tensor(noise.small_sq if noise is not None else 0.0)
        flags = torch.stack([loss_sum, (~torch.isfinite(norm)).to(torch.float64), stop, small_sq])
        self.log.record("all_reduce", "step flags (loss, non-finite, stop, local grad norm)", flags)
        dist.all_reduce(flags, group=self.group)
        if noise is not None:
            self.noise_scale.update(noise, float(flags[3]) / self.world_size)
        skipped = bool(flags[1] > 0)
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        self.stop_agreed = bool(flags[2] > 0)
        lr = self.optimizer.param_groups[0]["lr"]
        state = self.state
        if skipped:
            state.skipped_steps += 1
        elif self.cfg.grad_clip_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), self.cfg.grad_clip_norm, norm)
        self.precision.step(self.optimizer, skipped)
        if not skipped:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.samples_seen += batch.global_count
        state.last_loss = float(flags[0] / batch.global_count)
        for c in self.callbacks:
            c.after_step(self)
        step_s = time.perf_counter() - t0
        stats = getattr(model, "last_step_stats", None)
        return StepMetrics(
            step=state.step,
            samples_seen=state.samples_seen,
            loss=state.last_loss,
            lr=lr,
            grad_norm=float(norm),
            step_ms=step_s * 1e3,
            samples_per_s=batch.global_count / step_s,
            comm_ms=stats.comm_ms if stats else None,
            exposed_comm_ms=stats.exposed_comm_ms if stats else None,
            skipped=skipped,
            gns=self.noise_scale.b_simple,
        )

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

    # -- state and checkpoints (collective; see checkpointer.py) --------------------------------
    def stateful(self) -> dict[str, Stateful]:
        """The named objects a checkpoint saves from rank 0, each with state_dict/load_state_dict."""
        return {
            "model": self._module,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "sampler": self.sampler,
            "trainer": self.state,
        }

    def state_dict(self) -> dict:
        return {name: obj.state_dict() for name, obj in self.stateful().items()}

    def _rank_stateful(self) -> dict[str, Stateful]:
        """Each rank's own states: its RNG streams and (PowerSGD) its hook's error feedback."""
        states: dict[str, Stateful] = {"rng": RngState()}
        if self.comm_state is not None:
            states["comm_hook"] = HookState(self.comm_state, self._module)
        return states

    def _checkpointer(self) -> Checkpointer:
        def on_file(step: int, stem: str) -> None:
            for c in self.callbacks:
                c.on_checkpoint_file(step, stem)

        return Checkpointer(
            self.cfg.checkpoint_dir,
            group=self.group,
            log=self.log,
            keep_last=self.cfg.keep_checkpoints,
            expected_stems=(*self.stateful(), "rng"),  # a hook's state is there only with a hook
            on_file=on_file,
        )

    def save_checkpoint(self) -> str:
        """Collective: rank 0 writes this step's checkpoint; all learn the path."""
        self.state.grad_scaler = self.precision.state_dict()
        self.state.noise_scale = self.noise_scale.state_dict()
        extra = {"comm_hook": {"compression": self.cfg.compression}}
        self.last_checkpoint = self._checkpointer().save(
            self.step, self.stateful(), self._rank_stateful(), extra
        )
        return self.last_checkpoint

    def _resume(self) -> None:
        """Collective: continue from the newest checkpoint that verifies; a fresh start if there is none."""
        saved: list[TrainState] = []
        path = self._checkpointer().resume(
            lambda ckpt: saved.append(self.load_state_dict(ckpt.payload, ckpt.path))
        )
        if path is None:
            return
        self.resumed_from, self.last_checkpoint = self.step, path
        if self.rank == 0 and saved[0].world_size != self.world_size:
            old, s = saved[0], self.scheduler
            print(
                describe_resplit(old, self.state, self.cfg, s.last_epoch, s.base_lrs[0], self.total_steps),
                file=sys.stderr,
                flush=True,
            )

    def load_state_dict(self, payload: dict, where: Path | str = "checkpoint") -> TrainState:
        """Continue from a checkpoint's states (`stateful()`'s and `_rank_stateful()`'s names), also at
        another world size (resume.py's plan); returns the saved TrainState."""
        cfg, where = self.cfg, Path(where)
        saved = TrainState.from_state_dict(payload["trainer"], where / "trainer.pt")
        check_resumable(saved, global_batch=cfg.global_batch, world_change=cfg.world_change, where=where)
        for name in ("model", "optimizer", "scheduler"):
            load_into(self.stateful()[name].load_state_dict, payload[name], where / f"{name}.pt")
            if name == "optimizer":  # the loss scale with the optimizer state it scaled
                load_into(self.precision.load_state_dict, saved.grad_scaler, where / "trainer.pt")
        state = self.state
        state.step, state.samples_seen = saved.step, saved.samples_seen
        state.skipped_steps, state.last_loss = saved.skipped_steps, saved.last_loss
        state.batch_scale.load_state_dict(saved.batch_scale.state_dict())  # in place: the scheduler holds it
        load_into(self.noise_scale.load_state_dict, saved.noise_scale, where / "trainer.pt")
        if isinstance(self.model, DistributedDataParallel):  # one synced backward per step
            self.model.reducer.set_synced_steps(saved.step)
        current = BatchSplit(state.micro_batch, state.accumulation_steps)
        split = plan_split(
            saved,
            world_size=self.world_size,
            current=current,
            global_batch=state.global_batch,
            configured_global_batch=cfg.global_batch,
            world_change=cfg.world_change,
            where=where / "trainer.pt",
        )
        if split != current:
            self.set_batch_split(split.micro_batch, split.accumulation_steps)
        regroup = state.global_batch != saved.global_batch
        load_into(
            lambda s: self.sampler.load_state_dict(s, regroup=regroup),
            payload["sampler"],
            where / "sampler.pt",
        )
        if regroup:
            state.batch_scale.retarget(
                state.global_batch / cfg.global_batch, self.scheduler.last_epoch, cfg.rescale_warmup_steps
            )
        sync_lr(self.scheduler)
        self.total_steps = self.plan_total_steps()
        if self.comm_state is not None:
            HookState(self.comm_state, self._module).load_saved(
                payload.get("comm_hook"),
                self.cfg.compression,
                self.rank,
                self.world_size,
                where / "comm_hook.pt",
            )
        rngs = payload["rng"].get("ranks") if isinstance(payload["rng"], dict) else None
        if not rngs:
            raise CheckpointError(f"checkpoint {where / 'rng.pt'} holds no RNG states")
        # a restart with more workers than before: ranks beyond the old world reuse a saved stream
        RngState().load_state_dict(rngs[self.rank % len(rngs)])
        return saved


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
