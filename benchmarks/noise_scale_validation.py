"""Does S(B) = S_min (1 + B_noise / B) predict the steps to a target at 2B..16B from a run at B?

    python benchmarks/noise_scale_validation.py [--tasks digits,transformer,own] [--multipliers 1,2,4,8,16]
                                                [--json out.json]

McCandlish et al. 2018 (eq. 2.11): with the learning rate tuned for each batch, the optimizer steps
to a given loss follow S(B) = S_min (1 + B_noise / B). Per task this script trains at the global
batches B, 2B, 4B, 8B and 16B on one worker, each step accumulated from micro-batches of B/2 (the
first micro-batch against the whole step gives the noise scale, train/noise_scale.py), and counts
the steps until the eval loss first reaches the target (evaluated after every step). The run at B
gives the prediction: B_noise = its noise scale (B_simple from all its measured steps) and
S_min = S(B) / (1 + B_noise / B); every other batch is then predicted, not fitted. Two variants
come from the same runs at no extra training: the noise scale smoothed over the last ~20 steps of
the run at B instead of all its steps (it grows as the loss falls), and S_min, B_noise solved from
the steps measured at B and 2B (a two-run pilot), which predicts 4B..16B.

The learning rate at kB is the rate at B times AdaScale's gain r = (B_noise/B + 1) / (B_noise/(kB) + 1)
with the noise scale measured live in that run (train/adascale.py): that is the paper's optimal
rate eps(B) = eps_max / (1 + B_noise / B) expressed relative to B, the condition under which S(B)
is derived. Tasks: digits (SGD, momentum 0.9), the transformer on the synthetic token rule (AdamW,
a held-out set of 64 sequences), and examples/own_task.py (its own AdamW). Each task runs in one
spawned process with one intra-op thread; a run that spends its sample budget counts as missed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dpscale import Task
from dpscale.bench.weak import TargetWatch
from dpscale.multirank import run_ranks
from dpscale.train.adascale import AdaScaleGain
from dpscale.train.config import TrainConfig
from dpscale.train.trainer import Trainer
from dpscale.workloads import WORKLOADS, datasets, models
from dpscale.workloads.load import load_task

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TOLERANCE = 0.25


@dataclass(frozen=True)
class TaskSpec:
    name: str
    base_batch: int  # B; micro-batches are B/2
    target_loss: float  # on the eval set
    max_samples: int  # per batch size
    lr: float | None  # None: the task's own optimizer and rate
    optimizer: str = "sgd"


SPECS = {
    "digits": TaskSpec("digits", base_batch=8, target_loss=0.25, max_samples=40_000, lr=0.02),
    "transformer": TaskSpec(
        "transformer", base_batch=4, target_loss=0.2, max_samples=6_000, lr=1e-3, optimizer="adamw"
    ),
    "own": TaskSpec("own", base_batch=8, target_loss=0.1, max_samples=40_000, lr=None),
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
    return load_task("own_task:make", seed=0)  # seeded: the same pictures for every batch size


@dataclass
class BatchRun:
    task: str
    global_batch: int
    multiplier: int
    steps_to_target: int | None  # None: the budget ran out first
    noise_scale: float | None  # B_simple over the run's measured steps (samples)
    late_noise_scale: float | None  # the smoothed B_simple when the target was reached (~last 20 steps)
    mean_gain: float  # AdaScale's mean learning-rate multiplier over the run
    wall_s: float


def _train_all(rank: int, world: int, spec: TaskSpec, multipliers: list[int]) -> list[dict]:
    runs = []
    for k in multipliers:
        batch = k * spec.base_batch
        task = build_task(spec.name)
        watch = TargetWatch(name="loss", value=spec.target_loss, every_samples=batch)
        gain = AdaScaleGain(base_batch=spec.base_batch)
        with tempfile.TemporaryDirectory() as tmp:
            config = TrainConfig(
                global_batch=batch,
                micro_batch=spec.base_batch // 2,
                max_steps=max(1, spec.max_samples // batch),
                optimizer=spec.optimizer,
                lr=spec.lr,
                seed=0,
                progress="none",
                drift_check_every=0,
                noise_scale_every=1,
                metrics_dir=tmp,
            )
            t0 = time.perf_counter()
            result = Trainer(config, task, callbacks=[watch, gain]).fit()
            wall = time.perf_counter() - t0
        last = watch.checks[-1] if watch.checks else None
        reached = last is not None and last["value"] <= spec.target_loss
        runs.append(
            asdict(
                BatchRun(
                    task=spec.name,
                    global_batch=batch,
                    multiplier=k,
                    steps_to_target=last["step"] if reached else None,
                    noise_scale=result.gradient_noise_scale,
                    late_noise_scale=last["gns"] if last else None,
                    mean_gain=sum(gain.gains) / max(1, len(gain.gains)),
                    wall_s=wall,
                )
            )
        )
    return runs


def _law(s_at_b: float, b: int, noise: float):
    """S(.) through S(b) = s_at_b with B_noise = noise."""
    s_min = s_at_b / (1 + noise / b)
    return lambda batch: s_min * (1 + noise / batch)


def two_point_law(runs: list[dict]):
    """S_min and B_noise solved from the measured steps at B and 2B alone (two equations, two
    unknowns: S(B) - S(2B) = S_min B_noise / 2B), or None when those do not give a positive law."""
    at = {r["multiplier"]: r["steps_to_target"] for r in runs}
    s1, s2 = at.get(1), at.get(2)
    b = next(r["global_batch"] for r in runs if r["multiplier"] == 1)
    if not s1 or not s2 or not s1 > s2:
        return None
    s_min = 2 * s2 - s1
    if not s_min > 0:
        return None
    return _law(s1, b, 2 * b * (s1 - s2) / s_min)


def predictions(runs: list[dict]) -> list[dict]:
    """Each run with the steps S(kB) predicted three ways, and the relative errors:

    - `predicted_steps`: from the run at B and the noise scale it measured over all its steps;
    - `predicted_late`: the same with the noise scale smoothed over the run's last ~20 steps (the
      noise scale grows as the loss falls: late in the run it is nearer the one that governs the
      steps that reach the target);
    - `predicted_fit2`: S_min and B_noise solved from the measured steps at B and 2B (no noise
      scale: what a two-run pilot gives), for 4B and beyond."""
    base = next(r for r in runs if r["multiplier"] == 1)
    b, s_b = base["global_batch"], base["steps_to_target"]
    laws = {
        "": _law(s_b, b, base["noise_scale"]) if s_b and base["noise_scale"] else None,
        "_late": _law(s_b, b, base["late_noise_scale"]) if s_b and base.get("late_noise_scale") else None,
        "_fit2": two_point_law(runs),
    }
    out = []
    for r in runs:
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


def fitted(runs: list[dict]) -> tuple[float, float] | None:
    """(S_min, B_noise) that fit every measured S(B) best (least squares on S = S_min + S_min B_noise / B,
    linear in 1/B): what the noise scale would have had to be for the law to hold, to compare with
    the measured one. None with fewer than two reached runs or a fit that is not positive."""
    points = [(1 / r["global_batch"], r["steps_to_target"]) for r in runs if r["steps_to_target"]]
    if len(points) < 2:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    s_min = my - slope * mx
    return (s_min, slope / s_min) if s_min > 0 and slope > 0 else None


def table(rows: list[dict]) -> str:
    lines = [
        "| task | B | steps measured | predicted: noise scale of the run at B (error) "
        "| noise scale late in the run at B (error) | fit to B and 2B (error) "
        "| noise scale (this run: all steps / late) | mean LR gain |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(r, pred_key, err_key):
        if r[pred_key] is None:
            return "-"
        if r["multiplier"] == 1:
            return f"{r[pred_key]:.1f} (fit)"
        err = f"{r[err_key]:+.0%}" if r[err_key] is not None else "-"
        return f"{r[pred_key]:.1f} ({err})"

    for r in rows:
        measured = r["steps_to_target"] if r["steps_to_target"] is not None else "not reached"
        noise = f"{r['noise_scale']:.0f}" if r["noise_scale"] else "-"
        late = f"{r['late_noise_scale']:.0f}" if r.get("late_noise_scale") else "-"
        cells = (
            r["task"],
            r["global_batch"],
            measured,
            cell(r, "predicted_steps", "error"),
            cell(r, "predicted_late", "error_late"),
            cell(r, "predicted_fit2", "error_fit2"),
            f"{noise} / {late}",
            f"{r['mean_gain']:.2f}",
        )
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="digits,transformer,own")
    parser.add_argument("--multipliers", default="1,2,4,8,16")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    multipliers = [int(m) for m in args.multipliers.split(",")]
    if multipliers[0] != 1:
        parser.error("--multipliers: must start with 1 (the run the prediction comes from)")
    rows, fits = [], {}
    for name in args.tasks.split(","):
        if name not in SPECS:
            parser.error(f"--tasks: unknown {name!r}; choose from {', '.join(SPECS)}")
        runs = run_ranks(_train_all, 1, SPECS[name], multipliers, timeout_s=3600)[0]
        rows += predictions(runs)
        print(table(predictions(runs)), flush=True)
        fit = fitted(runs)
        base_noise = runs[0]["noise_scale"]
        fit_text = f"S_min {fit[0]:.1f}, B_noise {fit[1]:.1f}" if fit else "no positive fit"
        print(f"{name}: measured noise scale at B {base_noise or 0:.1f}; best fit of all batches: {fit_text}")
        fits[name] = {"measured_noise_scale": base_noise, "fit": fit}
    print()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "fits": fits}, indent=2))


if __name__ == "__main__":
    main()
