"""Does S(B) = S_min (1 + B_noise / B) predict the steps to a target at 2B..16B from runs at B?

    python benchmarks/noise_scale_validation.py [--tasks digits,transformer,own] [--seeds 0-15]
                                                [--multipliers 1,2,4,8,16] [--lr-factors 0.5,1,2]
                                                [--jobs 2] [--json out.json]
    python benchmarks/noise_scale_validation.py --render out.json [more.json ...]

McCandlish et al. 2018 (eq. 2.11): with the learning rate tuned for each batch, the optimizer steps
to a given loss follow S(B) = S_min (1 + B_noise / B). Per task and seed this script trains at the
global batches B, 2B, 4B, 8B and 16B on one worker, each step accumulated from micro-batches of B/2
(the first micro-batch against the whole step gives the noise scale, train/noise_scale.py), and
counts the steps until the eval loss first reaches the target. The seed moves the initial weights
and the data order (the data itself is the same for every seed).

The rules, fixed before any result was seen:
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
recomputed, a forward and backward on B/2 samples per step).

The learning rate at kB is the rate at B times AdaScale's gain r = (B_noise/B + 1) / (B_noise/(kB) + 1)
with the (plain) noise scale measured live in that run (train/adascale.py): the paper's optimal rate
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
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from dpscale import Task
from dpscale.engine.noise_scale import NoiseScaleEstimator
from dpscale.multirank import run_ranks
from dpscale.predict import goodput
from dpscale.train.adascale import AdaScaleGain
from dpscale.train.callbacks import TrainerCallback
from dpscale.train.config import TrainConfig
from dpscale.train.trainer import Trainer
from dpscale.workloads import WORKLOADS, datasets, models
from dpscale.workloads.load import load_task
from dpscale.workloads.task import call_model, to_device

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TOLERANCE = 0.25
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


def adam_preconditioner(optimizer: torch.optim.Optimizer, params: list) -> list[torch.Tensor] | None:
    """P = 1 / (sqrt(v_hat) + eps) per parameter, as Adam's next step divides by it (from the second
    moments of the steps so far); None for an optimizer without exp_avg_sq, or before its first step."""
    weights = []
    for group in optimizer.param_groups:
        beta2, eps = group.get("betas", (None, None))[1], group.get("eps")
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if p.grad is None:
                continue
            if "exp_avg_sq" not in state or beta2 is None:
                return None
            v_hat = state["exp_avg_sq"] / (1 - beta2 ** float(state["step"]))
            weights.append(1.0 / (v_hat.sqrt() + eps))
    return weights if len(weights) == len(params) else None


class PreconditionedNoise(TrainerCallback):
    """tr(P Sigma) / G^T P G from the first micro-batch's gradient against the accumulated one, both
    measured in the P-weighted norm |g|_P^2 = sum_i P_i g_i^2 (Adam's P of this step)."""

    def __init__(self):
        self.estimator = NoiseScaleEstimator()
        self._first: list[int] = []

    def on_batch(self, trainer, batch) -> None:
        self._first = batch.micro_batches[0]

    def after_reduce(self, trainer, grads) -> None:
        module = trainer.model.module
        params = [p for p in module.parameters() if p.grad is not None]
        weights = adam_preconditioner(trainer.optimizer, params)
        if weights is None or not 0 < len(self._first) < trainer.state.global_batch:
            return
        x, y = to_device(trainer.task.collate([trainer.train_data[i] for i in self._first]), trainer.device)
        # autograd.grad on the bare module: the engine's post-accumulate hooks do not fire, p.grad
        # (the accumulated gradient the optimizer is about to use) stays as it is
        loss = trainer.task.loss(call_model(module, x), y).float().mean()
        micro = torch.autograd.grad(loss, params)
        small = sum(float((w * g.float() ** 2).sum()) for w, g in zip(weights, micro, strict=True))
        big = sum(float((w * p.grad.float() ** 2).sum()) for w, p in zip(weights, params, strict=True))
        self.estimator.update(
            small_sq=small, big_sq=big, b_small=len(self._first), b_big=trainer.state.global_batch
        )


class FirstReach(TrainerCallback):
    """Ends the run when the eval loss first reaches the target (see the module docstring)."""

    def __init__(self, target: float, coarse_every: int = 1):
        self.target, self.coarse_every = target, coarse_every
        self.reached_at: int | None = None
        self.late_noise_scale: float | None = None
        self.coarse_hit = False
        self._last = (0, math.inf)  # (step, eval loss) of the last evaluation

    def after_step(self, trainer) -> None:
        last_step, last_loss = self._last
        if last_loss > COARSE_ABOVE * self.target and trainer.step - last_step < self.coarse_every:
            return
        loss = trainer.evaluate()["loss"]
        self._last = (trainer.step, loss)
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
    adam_trace_sum: float | None  # the same sums in Adam's preconditioned norm (None: not Adam)
    adam_grad_sq_sum: float | None
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


def _train_seed(
    rank: int, world: int, spec: TaskSpec, multipliers: list[int], seed: int, lr_factor: float = 1.0
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
        with tempfile.TemporaryDirectory() as tmp:
            config = TrainConfig(
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
        adam_sums = adam.estimator.state_dict() if adam and adam.estimator.updates else None
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
            adam_trace_sum=adam_sums["trace_sum"] if adam_sums else None,
            adam_grad_sq_sum=adam_sums["grad_sq_sum"] if adam_sums else None,
            mean_gain=statistics.fmean(gain.gains) if gain.gains else 1.0,
            lr_factor=lr_factor,
            wall_s=wall,
        )
        runs.append(asdict(run))
    return runs


def median_steps(steps: list[int | None]) -> float | None:
    """The median with a miss (None) counted as infinitely many steps; None when it lands on a miss."""
    value = statistics.median([math.inf if s is None else s for s in steps])
    return None if math.isinf(value) else value


def _pooled(runs: list[dict], trace: str, grad_sq: str) -> float | None:
    if any(r[trace] is None for r in runs):
        return None
    denominator = sum(r[grad_sq] for r in runs)
    return sum(r[trace] for r in runs) / denominator if denominator > 0 else None


def tune(runs: list[dict]) -> list[dict]:
    """Per batch, the runs at the learning-rate factor whose median steps are fewest (a tie goes to
    the factor nearest 1): the rate tuned per batch over the grid, as S(B) assumes. Runs of one
    factor are all kept (ordered by batch)."""
    kept = []
    for k in sorted({r["multiplier"] for r in runs}):
        same = [r for r in runs if r["multiplier"] == k]
        by_factor = {}
        for r in same:
            by_factor.setdefault(r.get("lr_factor", 1.0), []).append(r)

        def cost(item):
            factor, chosen = item
            median = median_steps([r["steps_to_target"] for r in chosen])
            return (math.inf if median is None else median, abs(math.log(factor)))

        kept += min(by_factor.items(), key=cost)[1]
    return kept


def rows_for(runs: list[dict]) -> list[dict]:
    """The rows with predictions for one task's runs (the rate tuned per batch when several factors ran)."""
    return predictions(aggregate(tune(runs)))


def aggregate(runs: list[dict]) -> list[dict]:
    """One row per batch over the seeds: the median steps and their min-max, the pooled noise
    scales (plain and Adam's) and the mean late one."""
    rows = []
    for k in sorted({r["multiplier"] for r in runs}):
        same = [r for r in runs if r["multiplier"] == k]
        reached = [r["steps_to_target"] for r in same if r["steps_to_target"] is not None]
        lates = [r["late_noise_scale"] for r in same if r["late_noise_scale"] is not None]
        rows.append(
            {
                "task": same[0]["task"],
                "multiplier": k,
                "global_batch": same[0]["global_batch"],
                "seeds": len(same),
                "steps": [r["steps_to_target"] for r in same],
                "steps_to_target": median_steps([r["steps_to_target"] for r in same]),
                "min_steps": min(reached, default=None),
                "max_steps": max(reached, default=None),
                "missed": len(same) - len(reached),
                "coarse_hits": sum(r["coarse_hit"] for r in same),
                "noise_scale": _pooled(same, "trace_sum", "grad_sq_sum"),
                "late_noise_scale": statistics.fmean(lates) if lates else None,
                "adam_noise_scale": _pooled(same, "adam_trace_sum", "adam_grad_sq_sum"),
                "mean_gain": statistics.fmean(r["mean_gain"] for r in same),
                "lr_factor": statistics.fmean(r.get("lr_factor", 1.0) for r in same),
            }
        )
    return rows


def _law(s_at_b: float, b: int, noise: float):
    """S(.) through S(b) = s_at_b with B_noise = noise: the law `dpscale predict --goodput` uses."""
    s_min = goodput.s_min_from_run(s_at_b, b, noise)
    return lambda batch: goodput.steps_to_target(batch, s_min=s_min, noise_scale=noise)


def two_point_law(rows: list[dict]):
    """S_min and B_noise solved from the measured steps at B and 2B alone (two equations, two
    unknowns: S(B) - S(2B) = S_min B_noise / 2B), or None when those do not give a positive law."""
    at = {r["multiplier"]: r["steps_to_target"] for r in rows}
    s1, s2 = at.get(1), at.get(2)
    b = next(r["global_batch"] for r in rows if r["multiplier"] == 1)
    if not s1 or not s2 or not s1 > s2:
        return None
    s_min = 2 * s2 - s1
    if not s_min > 0:
        return None
    return _law(s1, b, 2 * b * (s1 - s2) / s_min)


PREDICTIONS = {  # suffix of the row's keys -> what the prediction's B_noise is
    "": "noise scale at B (pooled over seeds)",
    "_late": "late noise scale at B",
    "_fit2": "fit to B and 2B",
    "_adam": "Adam-preconditioned noise scale at B",
}


def predictions(rows: list[dict]) -> list[dict]:
    """Each row with the steps S(kB) predicted four ways and their relative errors against the
    measured (median) steps: `predicted_steps` from the run at B and its noise scale;
    `predicted_late` with its late noise scale; `predicted_fit2` from the steps at B and 2B (4B and
    beyond); `predicted_adam` with the noise scale of Adam's preconditioned gradient."""
    base = next(r for r in rows if r["multiplier"] == 1)
    b, s_b = base["global_batch"], base["steps_to_target"]

    def from_noise(key):
        return _law(s_b, b, base[key]) if s_b and base.get(key) else None

    laws = {
        "": from_noise("noise_scale"),
        "_late": from_noise("late_noise_scale"),
        "_fit2": two_point_law(rows),
        "_adam": from_noise("adam_noise_scale"),
    }
    out = []
    for r in rows:
        row = dict(r)
        for suffix, law in laws.items():
            pred_key = "predicted_steps" if suffix == "" else "predicted" + suffix
            row[pred_key] = row["error" + suffix] = row["within" + suffix] = None
            if law is None or (suffix == "_fit2" and r["multiplier"] <= 2):
                continue
            row[pred_key] = law(r["global_batch"])
            if r["steps_to_target"]:
                row["error" + suffix] = row[pred_key] / r["steps_to_target"] - 1
                row["within" + suffix] = abs(row["error" + suffix]) <= TOLERANCE
        out.append(row)
    return out


def fitted(rows: list[dict]) -> tuple[float, float] | None:
    """(S_min, B_noise) that fit every measured S(B) best (least squares on S = S_min + S_min B_noise / B,
    linear in 1/B): what the noise scale would have had to be for the law to hold, to compare with
    the measured one. None with fewer than two reached rows or a fit that is not positive."""
    points = [(1 / r["global_batch"], r["steps_to_target"]) for r in rows if r["steps_to_target"]]
    if len(points) < 2:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    s_min = my - slope * mx
    return (s_min, slope / s_min) if s_min > 0 and slope > 0 else None


def error_bands(runs: list[dict], *, draws: int = 1000, seed: int = 0) -> dict[tuple[int, str], tuple]:
    """How much the seeds alone move each prediction's error: the p10-p90 of the error over `draws`
    bootstrap resamples of the seeds (the same seeds drawn for every batch, so each draw is a whole
    repetition of the experiment), keyed by (multiplier, prediction suffix)."""
    seeds = sorted({r["seed"] for r in runs})
    by_seed = {s: [r for r in runs if r["seed"] == s] for s in seeds}
    rng = random.Random(seed)
    errors: dict[tuple[int, str], list[float]] = {}
    for _ in range(draws):
        drawn = [r for _ in seeds for r in by_seed[rng.choice(seeds)]]
        for row in rows_for(drawn):
            for suffix in PREDICTIONS:
                if row["error" + suffix] is not None:
                    errors.setdefault((row["multiplier"], suffix), []).append(row["error" + suffix])
    bands = {}
    for key, values in errors.items():
        if len(values) >= 2:
            cuts = statistics.quantiles(values, n=10)
            bands[key] = (cuts[0], cuts[-1])
    return bands


def _num(value, fmt: str = ".0f") -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: list[dict]) -> str:
    heads = " | ".join(f"{what} (error [p10..p90 over the seeds])" for what in PREDICTIONS.values())
    lines = [
        f"| task | B | steps: median (min-max, missed/seeds) | {heads} "
        "| noise scale: pooled / late / Adam | mean LR gain x factor |",
        "|:---|---:|---:|" + "---:|" * len(PREDICTIONS) + "---:|---:|",
    ]

    def cell(r, suffix):
        pred = r["predicted_steps" if suffix == "" else "predicted" + suffix]
        if pred is None:
            return "-"
        if r["multiplier"] == 1:
            return f"{pred:.1f} (fit)"
        band = r.get("band" + suffix)
        band = f" [{band[0]:+.0%}..{band[1]:+.0%}]" if band else ""
        return f"{pred:.1f} ({_num(r['error' + suffix], '+.0%')}{band})"

    for r in rows:
        measured = "not reached" if r["steps_to_target"] is None else f"{r['steps_to_target']:g}"
        spread = f"{_num(r['min_steps'])}-{_num(r['max_steps'])}, {r['missed']}/{r['seeds']}"
        noise = " / ".join(
            _num(r[k], ".0f" if (r[k] or 0) >= 10 else ".2g")
            for k in ("noise_scale", "late_noise_scale", "adam_noise_scale")
        )
        cells = [r["task"], r["global_batch"], f"{measured} ({spread})"]
        cells += [cell(r, suffix) for suffix in PREDICTIONS] + [
            noise,
            f"{r['mean_gain']:.2f} x {r.get('lr_factor', 1.0):g}",
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def parse_seeds(text: str) -> list[int]:
    """ "0-7" or "0,3,5" -> the seeds."""
    if "-" in text:
        first, last = (int(x) for x in text.split("-"))
        return list(range(first, last + 1))
    return [int(x) for x in text.split(",")]


def report(runs: list[dict]) -> dict:
    """Per task: the rows with predictions, each error's band over the seeds ("band" + suffix: its
    bootstrap p10-p90) and the least-squares fit of all batches; with several learning-rate
    factors, once at the factor 1 (AdaScale's rate) as "NAME" and once tuned per batch as
    "NAME, rate tuned" (the selection redone in every bootstrap draw)."""
    out = {}
    for name in dict.fromkeys(r["task"] for r in runs):
        mine = [r for r in runs if r["task"] == name]
        variants = {name: [r for r in mine if r.get("lr_factor", 1.0) == 1.0]}
        if len({r.get("lr_factor", 1.0) for r in mine}) > 1:
            variants[f"{name}, rate tuned"] = mine
        for label, chosen in variants.items():
            if not chosen:
                continue
            rows, bands = rows_for(chosen), error_bands(chosen)
            for row in rows:
                for suffix in PREDICTIONS:
                    row["band" + suffix] = bands.get((row["multiplier"], suffix))
            out[label] = {"rows": rows, "fit": fitted(rows)}
    return out


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
        units = [(name, f, seed) for name in names for f in factors for seed in parse_seeds(args.seeds)]

        def one(unit):
            name, factor, seed = unit
            spec = replace(SPECS[name], coarse_every=1) if args.every_step else SPECS[name]
            runs = run_ranks(_train_seed, 1, spec, multipliers, seed, factor, timeout_s=3600)[0]
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
    if args.json and not args.render:
        Path(args.json).write_text(json.dumps({"runs": runs, "tasks": results}, indent=2))


if __name__ == "__main__":
    main()
