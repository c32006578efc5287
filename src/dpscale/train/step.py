"""One optimizer step of the training loop: micro-batches, the synced backward, the step flags, the update.

`Trainer`'s step (its state is set up in trainer.py). Each micro-batch's forward and backward runs
under `no_sync` except the last, whose backward the engine reduces. Losses are sums over samples
scaled by W / global count, so the reduced gradient is the full-batch mean. Then one small
all-reduce (the loss, a non-finite flag, a stop request, the local gradient norm) gives every rank
the same skip and stop decisions, and the optimizer and scheduler step.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from dpscale.data.sampler import StepBatch
from dpscale.train.adaptive.noise_scale import grad_sq_norm
from dpscale.train.metrics import StepMetrics
from dpscale.workloads.task import call_model, per_sample, to_device


class TrainStep:
    """`_train_step`, mixed into `Trainer`."""

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
            loss_scale=self.precision.loss_scale(),
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
            # the norm just taken for the skip check is the big-batch norm: no second read
            small_sq = float(flags[3]) / self.world_size  # the ranks' local norms, averaged
            self.noise_scale.update(noise, small_sq, reduced_sq=float(norm) ** 2)
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
