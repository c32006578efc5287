"""Check `dpscale predict` against measurement: on this machine and on emulated clusters.

See docs/performance-model.md; the third check there, against published results, is archived:
benchmarks/archive/predict_published.py.

    python benchmarks/predict_validation.py local [--models mlp,transformer] [--steps 30]
        this machine: all-reduce bench (gloo, shm) for calibration, then per model a one-worker
        profile (with the in-step sync calibration of two co-located workers, predict/sync.py) and,
        in another run, a scaling bench at world sizes 1 and 2 (dpscale on shm once more, alone:
        with_shm_alone); predicted vs measured step times, and the bare step profiled again after
        the bench (the drift the machine's load alone causes)
    python benchmarks/predict_validation.py validate SCALING_DIR --profile FILE [--calibrate ALLREDUCE_DIR]
        the same check for reports you already have (the profile must come from another run)
    python benchmarks/predict_validation.py emulate [--hosts 2] [--rate-gbit 1] [--transport gloo]
        an emulated multi-host cluster (network namespaces, tbf-shaped links; needs root)

Reports go to reports/<UTC>-<name>/ like every bench's.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # predict_lab, beside this script

from predict_lab import emulate, emulate_validate, validate  # noqa: E402

from dpscale.lab.bench import allreduce, allreduce_report, scaling, scaling_report  # noqa: E402
from dpscale.lab.bench.report import ReportDir, Section, Table  # noqa: E402
from dpscale.lab.predict import profile, profiling, render  # noqa: E402
from dpscale.lab.predict.cluster import load_allreduce_report  # noqa: E402

MIN_BENCH_S = 2.0


def run_local(args: argparse.Namespace) -> int:
    ar = allreduce.run(allreduce.AllReduceConfig(transports=["gloo", "shm"], world_sizes=[1, 2]))
    ar_report = ReportDir.create(args.report_dir, "allreduce")
    allreduce_report.write_report(ar, ar_report)
    print(allreduce_report.format_fits(ar))
    calibration = load_allreduce_report(ar_report.path)
    for model in args.models.split(","):
        load_before = os.getloadavg()[0]
        # the profile is its own run, before the scaling bench: the prediction takes nothing from it
        prof = profiling.measure(model, args.per_worker_batch, co_located=2)
        print(render.profile_summary(prof))
        config = scaling.ScalingConfig(
            model=model,
            per_worker_batch=args.per_worker_batch,
            world_sizes=[1, 2],
            # at least --steps, and ~2 s per engine: 30 steps of a 1 ms model are 30 ms of data
            steps=max(args.steps, math.ceil(MIN_BENCH_S * 1e3 / max(prof.compute_ms, 1e-3))),
            # every transport of the acceptance line: dpscale on shm (N=2) and gloo, torch DDP on gloo
            engines=["dpscale", "dpscale-gloo", "torch", "local"],
        )
        sc = scaling.run(config)
        sc_report = ReportDir.create(args.report_dir, "scaling")
        scaling_report.write_report(sc, sc_report)
        scaling_doc = with_shm_alone(sc.to_dict(), config, args.report_dir)
        prof.save(sc_report.path / "profile.json")  # the prediction's input, next to what it predicts
        # the same one-worker profile once more, after the bench: how far the load moved the compute
        # between the two runs, i.e. the error a perfect model would still show on this machine
        after = profiling.measure(model, args.per_worker_batch, co_located=2)
        after.save(sc_report.path / "profile-after.json")
        print(load_drift(prof, after, load_before))
        for statistic in args.statistics.split(","):
            _check(scaling_doc, prof, calibration, str(sc_report.path), str(ar_report.path), statistic, args)
    return 0


def with_shm_alone(doc: dict, config: scaling.ScalingConfig, report_dir) -> dict:
    """`doc` with dpscale's shm rows timed in a run of their own, as a training job runs.

    Between the gloo engines' 5-step rounds, shm steps 2-5x faster on a loaded machine than it
    does alone (benchmarks/shm_interleaved.py, docs/performance-model.md), and the prediction's
    shm calibration (predict/sync.py) times continuous synchronized steps.
    """
    shm = [p for p in doc["points"] if p["engine"] == "dpscale" and p["transport"] == "shm"]
    if not shm:
        return doc
    sizes = sorted({p["world_size"] for p in shm})
    alone = scaling.run(replace(config, engines=["dpscale"], world_sizes=sizes))
    scaling_report.write_report(alone, ReportDir.create(report_dir, "scaling-shm-alone"))
    alone_doc = alone.to_dict()
    keys = {(p["engine"], p["world_size"]) for p in shm}

    def merged(name: str) -> list:
        kept = [r for r in doc.get(name, []) if (r["engine"], r["world_size"]) not in keys]
        return kept + [r for r in alone_doc.get(name, []) if (r["engine"], r["world_size"]) in keys]

    print(f"dpscale on shm timed alone (N = {', '.join(str(n) for _, n in sorted(keys))}), as a job runs")
    return {**doc, "points": merged("points"), "runs": merged("runs")}


def load_drift(before: profile.ModelProfile, after: profile.ModelProfile, load_before: float) -> str:
    """One line: the bare step before and after the scaling bench, and the load average around them."""
    drift = after.compute_ms / before.compute_ms - 1
    line = (
        f"{before.model}: bare step {before.compute_ms:.2f} ms before the bench, {after.compute_ms:.2f} ms "
        f"after ({drift:+.1%})"
    )
    # two workers in lockstep on the node: the slowdown the N = 2 predictions take from the profile
    pairs = [
        (k, before.contention[k], after.contention[k]) for k in before.contention if k in after.contention
    ]
    for k, b, a in pairs:
        line += f"; {k} co-located workers {b:.2f}x slower before, {a:.2f}x after"
    return line + f"; load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"


def _check(scaling_doc, prof, calibration, scaling_path, calibration_path, statistic, args) -> None:
    result = validate.validate(
        scaling_doc,
        prof,
        allreduce=calibration,
        scaling_report=scaling_path,
        calibration=calibration_path,
        statistic=statistic,
    )
    print(f"\n{prof.model}: scaling report {scaling_path}")
    print(validate.format_table(result))
    report = ReportDir.create(args.report_dir, "predict-validate")
    validate.write_report(result, report)
    print(f"report: {report.path}")


def run_validate(args: argparse.Namespace) -> int:
    scaling_doc = validate.load_scaling_report(args.scaling_report, flag="scaling_report")
    prof = profile.ModelProfile.load(args.profile)
    calibration = load_allreduce_report(args.calibrate) if args.calibrate else None
    for statistic in args.statistics.split(","):
        _check(scaling_doc, prof, calibration, args.scaling_report, args.calibrate, statistic, args)
    return 0


def run_emulate(args: argparse.Namespace) -> int:
    config = emulate.EmulationConfig(
        hosts=args.hosts,
        workers_per_host=args.workers_per_host,
        rate_gbit=args.rate_gbit,
        transport=args.transport,
        model=args.model,
        per_worker_batch=args.per_worker_batch,
        steps=args.steps,
    )
    if why := emulate.unavailable():
        print(f"cannot emulate a cluster here: {why}", file=sys.stderr)
        return 1
    prof = profiling.measure(config.model, config.per_worker_batch)
    result = emulate.run(config)
    rows = emulate_validate.validate_emulation(result, prof)
    # the same step with the link's rate from this run's all-reduce: what the host's load leaves out
    (from_run,) = emulate_validate.validate_emulation(result, prof, link_from_run=True)[-1:]
    from_run = replace(from_run, what=from_run.what + ", link rate from the run")
    rows.append(from_run)
    cluster = emulate_validate.emulated_cluster(result)
    print(render.profile_summary(prof))
    print(f"cluster {cluster.describe()}; emulated bare-model step {result.local_step_ms:.2f} ms")
    print(emulate_validate.format_emulation(rows))
    report = ReportDir.create(args.report_dir, "predict-emulate")
    doc = {"emulation": result.to_dict(), "rows": [asdict(r) for r in rows]}
    report.write_json(doc, config=asdict(config))
    report.write_markdown(
        "Prediction vs an emulated multi-host cluster",
        [
            Section(
                "Setup",
                [
                    f"- **Cluster:** {cluster.describe()}",
                    f"- **Profile:** {render.profile_summary(prof)}",
                    f"- **Training transport:** {result.transport}",
                ],
            ),
            Section("Results", [Table([asdict(r) for r in rows], list(asdict(rows[0])))]),
        ],
    )
    print(f"report: {report.path}")
    return 0 if all(r.within_target for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report-dir", default="reports")
    sub = parser.add_subparsers(dest="what", required=True)
    local = sub.add_parser("local", help="this machine: scaling bench vs prediction")
    local.add_argument("--models", default="digits,synthetic,mlp,transformer")
    local.add_argument("--per-worker-batch", type=int, default=64)
    local.add_argument("--steps", type=int, default=30)
    local.add_argument("--statistics", default="median,paired", help="median, paired or pNN (validate.py)")
    local.set_defaults(func=run_local)
    val = sub.add_parser("validate", help="reports you have: scaling report vs a profile from another run")
    val.add_argument("scaling_report", help="a `dpscale bench scaling` report directory")
    val.add_argument("--profile", required=True, help="a `dpscale profile` file from another run")
    val.add_argument("--calibrate", default=None, help="a `dpscale bench allreduce` report directory")
    val.add_argument("--statistics", default="median", help="median, paired or pNN (validate.py)")
    val.set_defaults(func=run_validate)
    emu = sub.add_parser("emulate", help="an emulated multi-host cluster (root)")
    emu.add_argument("--hosts", type=int, default=2)
    emu.add_argument("--workers-per-host", type=int, default=1)
    emu.add_argument("--rate-gbit", type=float, default=1.0)
    emu.add_argument("--transport", default="gloo", help="gloo, or auto (hierarchical across hosts)")
    emu.add_argument("--model", default="mlp")
    emu.add_argument("--per-worker-batch", type=int, default=16)
    emu.add_argument("--steps", type=int, default=4)
    emu.set_defaults(func=run_emulate)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
