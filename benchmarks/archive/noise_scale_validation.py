"""Does S(B) = S_min (1 + B_noise / B) predict the steps to a target at 2B..16B from runs at B?

    python benchmarks/archive/noise_scale_validation.py [--tasks digits,transformer,own] [--seeds 0-15]
                                                [--multipliers 1,2,4,8,16] [--lr-factors 0.5,1,2]
                                                [--jobs 2] [--json out.json]
    python benchmarks/archive/noise_scale_validation.py --render out.json [more.json ...]

McCandlish et al. 2018 (eq. 2.11): with the learning rate tuned for each batch, the optimizer steps
to a given loss follow S(B) = S_min (1 + B_noise / B). Per task and seed this script trains at the
global batches B, 2B, 4B, 8B and 16B on one worker, each step accumulated from micro-batches of B/2
(the first micro-batch against the whole step gives the noise scale, train/adaptive/noise_meter.py), and
counts the steps until the eval loss first reaches the target. The seed moves the initial weights
and the data order (the data itself is the same for every seed).

The rules, fixed before any result was seen (benchmarks/archive/noise_scale_report.py applies them):
- per batch, the MEDIAN over the seeds of the steps to target is the measured S(kB) (a seed that
  spends its step budget counts as infinitely many steps; a median that lands on one is a miss);
  the spread is the seeds' min-max;
- the noise scale at B is pooled over the seeds: the sums of the per-step unbiased tr(Sigma) and
  |G|^2 estimates over every measured step of every seed's run at B, divided;
- S_min = median S(B) / (1 + B_noise / B); every other batch is predicted, not fitted, and is
  within the model when |predicted / median - 1| <= 25%.

Four predictions come from the same runs, no extra training: (1) the pooled noise scale at B; (2)
the mean over seeds of the noise scale smoothed over the last ~20 steps of each run at B; (3) S_min
and B_noise solved from the medians at B and 2B (a two-run pilot), for 4B..16B; (4) for Adam-family
optimizers, the noise scale of the preconditioned gradient tr(P Sigma) / G^T P G with
P = diag(1 / (sqrt(v_hat) + eps)) from the optimizer's exp_avg_sq (docs/noise-scale.md derives it),
measured from the same micro-batch and accumulated gradient pair (the micro-batch's gradient is
recomputed, a forward and backward on B/2 samples per step; benchmarks/archive/noise_scale_adam.py).
Two more (added 2026-12-01, 20:19, before any of their values was seen; the same pooling and the
same 25% rule): (5) the law's own B_noise = tr(H Sigma) / G^T H G (McCandlish et al. eq. 2.7; B_simple
is it with H = I), the same pair measured in the Hessian's norm, H applied by Hessian-vector
products on an independent batch of B samples each step of the runs at B; (6) for Adam-family
optimizers its preconditioned form tr(P H P Sigma) / G^T P H P G, the pair measured on P g
(benchmarks/archive/noise_scale_hessian.py). They measure the runs at B only (`--hessian-at`), which train
exactly as without them (the extra passes touch no .grad, no optimizer state, no data order).

The learning rate at kB is the rate at B times AdaScale's gain r = (B_noise/B + 1) / (B_noise/(kB) + 1)
with the (plain) noise scale measured live in that run (train/adaptive/adascale.py): the paper's optimal rate
eps(B) = eps_max / (1 + B_noise / B) relative to B. `--lr-factors` multiplies that rate by each
factor at every batch (B included); the report then also gives each task with the rate tuned per
batch: at each batch the factor with the fewest median steps (a tie to the factor nearest 1), the
noise scale at B from the runs chosen at B. Evaluation after every step, except for the
transformer (whose 64 held-out sequences cost as much as its training): every 4 steps while the
last eval loss is above twice the target, every step after (a run that met the target straight
from above twice it is flagged `coarse_hit`: its count may be up to 3 steps late). Tasks: digits (SGD,
momentum 0.9), the transformer on the synthetic token rule (AdamW, 64 held-out sequences) and
examples/own_task.py (its own AdamW). Each (task, seed) runs in one spawned process with one
intra-op thread; `--jobs` of them at once.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from noise_scale_adam import PreconditionedNoise  # benchmarks/archive/, beside this script
from noise_scale_hessian import HessianNoise
from noise_scale_report import drop_split, drop_table, report, table

from dpscale import Task
from dpscale.lab.multirank import run_ranks
from dpscale.train.adaptive.adascale import AdaScaleGain
from dpscale.train.callbacks import TrainerCallback
from dpscale.train.config import TrainConfig
from dpscale.train.trainer import Trainer
from dpscale.workloads import WORKLOADS, datasets, models
from dpscale.workloads.load import load_task

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
COARSE_ABOVE = 2.0  # evaluate every TaskSpec.coarse_every steps while the eval loss is above 2 x target


@dataclass(frozen=True)
class TaskSpec:
    name: str
    base_batch: int  # B; micro-batches are B/2
    target_loss: float  # on the eval set
    max_steps: int  # per run; beyond it the run counts as a miss
    lr: float | None  # None: the task's own optimizer and rate
    optimizer: str = "sgd"
    coarse_every: int = 1  # 1: evaluate after every step (exact); the transformer's evaluation is costly


SPECS = {
    "digits": TaskSpec("digits", base_batch=8, target_loss=0.25, max_steps=800, lr=0.02),
    "transformer": TaskSpec(
        "transformer",
        base_batch=4,
        target_loss=0.2,
        max_steps=240,
        lr=1e-3,
        optimizer="adamw",
        coarse_every=4,
    ),
    "own": TaskSpec("own", base_batch=8, target_loss=0.1, max_steps=500, lr=None),
}


def build_task(name: str) -> Task:
    if name == "digits":
        return WORKLOADS["digits"].task(0)
    if name == "transformer":
        work = WORKLOADS["transformer"]
        held_out = datasets.synthetic_tokens(64, 64, seed=1)  # the same rule, other starts
        return Task(models.transformer, datasets.synthetic_tokens(2048, 64, seed=0), held_out, loss=work.loss)
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return load_task("own_task:make", seed=0)  # seeded: the same pictures for every seed and batch


class FirstReach(TrainerCallback):
    """Ends the run when the eval loss first reaches the target (see the module docstring)."""

    def __init__(self, target: float, coarse_every: int = 1):
        self.target, self.coarse_every = target, coarse_every
        self.reached_at: int | None = None
        self.late_noise_scale: float | None = None
        self.coarse_hit = False
        self.curve: list[tuple[int, float]] = []  # (step, eval loss) of every evaluation: the drop's shape
        self._last = (0, math.inf)  # (step, eval loss) of the last evaluation

    def after_step(self, trainer) -> None:
        last_step, last_loss = self._last
        if last_loss > COARSE_ABOVE * self.target and trainer.step - last_step < self.coarse_every:
            return
        loss = trainer.evaluate()["loss"]
        self._last = (trainer.step, loss)
        self.curve.append(self._last)
        if loss <= self.target:
            self.reached_at, self.late_noise_scale = trainer.step, trainer.noise_scale.b_simple
            self.coarse_hit = last_loss > COARSE_ABOVE * self.target and trainer.step - last_step > 1
            trainer.total_steps = trainer.step


@dataclass
class BatchRun:
    task: str
    seed: int
    global_batch: int
    multiplier: int
    steps_to_target: int | None  # None: the step budget ran out first
    coarse_hit: bool
    trace_sum: float  # sums of the per-step unbiased tr(Sigma) and |G|^2 estimates (samples)
    grad_sq_sum: float
    late_noise_scale: float | None  # the smoothed B_simple when the target was reached (~last 20 steps)
    eval_losses: list[tuple[int, float]]  # (step, eval loss) of every evaluation up to the target
    adam_trace_sum: float | None  # the same sums in Adam's preconditioned norm (None: not Adam)
    adam_grad_sq_sum: float | None
    # the same sums in the Hessian's norm (--hessian-at batches only), plain and Adam-preconditioned
    hessian_trace_sum: float | None
    hessian_grad_sq_sum: float | None
    hessian_adam_trace_sum: float | None
    hessian_adam_grad_sq_sum: float | None
    mean_gain: float  # AdaScale's mean learning-rate multiplier over the run
    lr_factor: float  # on top of AdaScale's rate (--lr-factors)
    wall_s: float


class RateFactor(TrainerCallback):
    """Multiplies every step's learning rate by `factor` (after AdaScale's gain): the grid that tunes
    the rate per batch. The scheduler sets the rate afresh each step, so it does not compound."""

    def __init__(self, factor: float):
        self.factor = factor

    def after_reduce(self, trainer, grads) -> None:
        for group in trainer.optimizer.param_groups:
            group["lr"] *= self.factor


def _sums(estimator) -> tuple[float | None, float | None]:
    if estimator is None or not estimator.updates:
        return None, None
    sums = estimator.state_dict()
    return sums["trace_sum"], sums["grad_sq_sum"]


def _train_seed(
    rank: int,
    world: int,
    spec: TaskSpec,
    multipliers: list[int],
    seed: int,
    lr_factor: float = 1.0,
    hessian_at: tuple[int, ...] = (1,),
) -> list[dict]:
    runs = []
    for k in multipliers:
        batch = k * spec.base_batch
        reach, gain, adam = (
            FirstReach(spec.target_loss, spec.coarse_every),
            AdaScaleGain(base_batch=spec.base_batch),
            None,
        )
        callbacks: list[TrainerCallback] = [reach, gain, RateFactor(lr_factor)]
        if spec.optimizer != "sgd" or spec.lr is None:  # AdamW, the trainer's or the task's own
            adam = PreconditionedNoise()
            callbacks.append(adam)
        hessian = HessianNoise(seed) if k in hessian_at else None
        if hessian:
            callbacks.append(hessian)
        with tempfile.TemporaryDirectory() as tmp:
            config = TrainConfig.from_flat(
                global_batch=batch,
                micro_batch=spec.base_batch // 2,
                max_steps=spec.max_steps,
                optimizer=spec.optimizer,
                lr=spec.lr,
                seed=seed,
                progress="none",
                drift_check_every=0,
                noise_scale_every=1,
                metrics_dir=tmp,
            )
            t0 = time.perf_counter()
            trainer = Trainer(config, build_task(spec.name), callbacks=callbacks)
            trainer.fit()
            wall = time.perf_counter() - t0
        sums = trainer.noise_scale.state_dict()
        adam_sums = _sums(adam.estimator if adam else None)
        hess_sums = _sums(hessian.plain if hessian else None)
        hess_adam_sums = _sums(hessian.preconditioned if hessian else None)
        run = BatchRun(
            task=spec.name,
            seed=seed,
            global_batch=batch,
            multiplier=k,
            steps_to_target=reach.reached_at,
            coarse_hit=reach.coarse_hit,
            trace_sum=sums["trace_sum"],
            grad_sq_sum=sums["grad_sq_sum"],
            late_noise_scale=reach.late_noise_scale,
            eval_losses=reach.curve,
            adam_trace_sum=adam_sums[0],
            adam_grad_sq_sum=adam_sums[1],
            hessian_trace_sum=hess_sums[0],
            hessian_grad_sq_sum=hess_sums[1],
            hessian_adam_trace_sum=hess_adam_sums[0],
            hessian_adam_grad_sq_sum=hess_adam_sums[1],
            mean_gain=statistics.fmean(gain.gains) if gain.gains else 1.0,
            lr_factor=lr_factor,
            wall_s=wall,
        )
        runs.append(asdict(run))
    return runs


def parse_seeds(text: str) -> list[int]:
    """ "0-7" or "0,3,5" -> the seeds."""
    if "-" in text:
        first, last = (int(x) for x in text.split("-"))
        return list(range(first, last + 1))
    return [int(x) for x in text.split(",")]


def _by_task_and_factor(runs: list[dict]) -> dict[tuple[str, float], list[dict]]:
    groups: dict[tuple[str, float], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["task"], r.get("lr_factor", 1.0)), []).append(r)
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="digits,transformer,own")
    parser.add_argument("--seeds", default="0-15", help="e.g. 0-7 or 0,1,2")
    parser.add_argument("--multipliers", default="1,2,4,8,16")
    parser.add_argument(
        "--lr-factors", default="1", help="factors on AdaScale's rate to try at every batch, e.g. 0.5,1,2"
    )
    parser.add_argument(
        "--every-step", action="store_true", help="evaluate after every step on every task (exact counts)"
    )
    parser.add_argument(
        "--hessian-at",
        default="1",
        help="multipliers whose runs also measure the Hessian noise scale (5-6 use 1's); '' for none",
    )
    parser.add_argument("--jobs", type=int, default=1, help="(task, seed) processes at once")
    parser.add_argument("--json", help="write every run and the rows here")
    parser.add_argument("--render", nargs="+", help="print the tables of --json files instead of training")
    args = parser.parse_args()
    if args.render:
        runs = [r for path in args.render for r in json.loads(Path(path).read_text())["runs"]]
        keys = [(r["task"], r["seed"], r["multiplier"], r.get("lr_factor", 1.0)) for r in runs]
        if len(set(keys)) < len(keys):
            parser.error(
                "--render: the files hold the same (task, seed, batch, rate factor) twice; give each once"
            )
    else:
        multipliers = [int(m) for m in args.multipliers.split(",")]
        if multipliers[0] != 1:
            parser.error("--multipliers: must start with 1 (the run the prediction comes from)")
        names = args.tasks.split(",")
        for name in names:
            if name not in SPECS:
                parser.error(f"--tasks: unknown {name!r}; choose from {', '.join(SPECS)}")
        factors = [float(f) for f in args.lr_factors.split(",")]
        hessian_at = tuple(int(m) for m in args.hessian_at.split(",") if m)
        units = [(name, f, seed) for name in names for f in factors for seed in parse_seeds(args.seeds)]

        def one(unit):
            name, factor, seed = unit
            spec = replace(SPECS[name], coarse_every=1) if args.every_step else SPECS[name]
            runs = run_ranks(_train_seed, 1, spec, multipliers, seed, factor, hessian_at, timeout_s=3600)[0]
            print(
                f"{name} lr x{factor:g} seed {seed}: steps {[r['steps_to_target'] for r in runs]}", flush=True
            )
            return runs

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            runs = [r for unit_runs in pool.map(one, units) for r in unit_runs]
    results = report(runs)
    for name, result in results.items():
        print()
        print(table(result["rows"]))
        fit = result["fit"]
        fit_text = f"S_min {fit[0]:.1f}, B_noise {fit[1]:.1f}" if fit else "no positive fit"
        print(f"{name}: best fit of all batches' medians: {fit_text}")
    for (name, factor), mine in _by_task_and_factor(runs).items():
        split = drop_split(mine)
        if split:
            print(f"\n{name}, rate x{factor:g}: where the steps go (the start, then the drop)")
            print(drop_table(split))
    if args.json and not args.render:
        Path(args.json).write_text(json.dumps({"runs": runs, "tasks": results}, indent=2))


if __name__ == "__main__":
    main()
