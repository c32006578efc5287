"""`dpscale profile` and `dpscale predict`: one `add_*_arguments` / `run_*_from_args` pair per command.

    dpscale profile --model mlp --per-worker-batch 64 [--out FILE] [--json]
    dpscale predict --model mlp --preset dgx-a100 [--world-sizes 1,8,64,512] [--json]
    dpscale predict --profile FILE --calibrate REPORT_DIR          (this machine, measured transport)
    dpscale predict --params 25.6e6 --step-compute-ms 120 --preset pcie3-x16+eth-25g --nodes 32
    dpscale predict --goodput --noise-scale RUN.json --model mlp --per-worker-batches 16,64,256

Bad input raises ValueError naming the flag (the dpscale CLI turns it into exit code 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from dpscale.errors import ConfigError
from dpscale.flags import add_dataclass_arguments, dataclass_kwargs
from dpscale.lab.bench.args import parse_int_list
from dpscale.lab.bench.report import ReportDir, require_plots
from dpscale.lab.predict import compression_cost, goodput, profiling, render
from dpscale.lab.predict import profile as profiles
from dpscale.lab.predict.cluster import (
    Cluster,
    calibrated,
    load_allreduce_report,
    preset_cluster,
)
from dpscale.lab.predict.degrade import ScaleTerms, cv_from_tail
from dpscale.lab.predict.fabric_fit import calibrated_from, read_measurements
from dpscale.lab.predict.from_scale import (
    ScaleRun,
    calibrated_compute,
    calibrated_fabric,
    read_scale_report,
    report_profile,
)
from dpscale.lab.predict.model import PredictConfig, check_bounds, predict
from dpscale.lab.predict.options import DEFAULT_BATCH, PredictOptions
from dpscale.paths import check_writable_dir, check_writable_file

MAX_DEFAULT_WORLD = 1024

# ---- dpscale profile ------------------------------------------------------------------------------


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(parser, profiles.ProfileConfig)
    parser.add_argument(
        "--json", action="store_true", help="print the profile as JSON on the last line of stdout"
    )


def run_profile_from_args(args: argparse.Namespace) -> int:
    config = profiles.ProfileConfig(**dataclass_kwargs(args, profiles.ProfileConfig))
    # where the profile goes, before measuring it (the default file is in the current directory)
    if config.out:
        check_writable_file("--out", config.out)
    else:
        check_writable_dir("--out", ".")
    prof = profiling.measure(
        config.model,
        config.per_worker_batch,
        steps=config.steps,
        warmup=config.warmup,
        threads=config.threads,
        co_located=config.co_located,
        device=config.device,
    )
    path = prof.save(config.out or f"profile-{prof.model}-b{prof.per_worker_batch}.json")
    print(render.profile_summary(prof))
    for b in prof.buckets():
        print(f"  bucket {b.index}: {b.nbytes / 2**20:.2f} MiB ready at {b.ready_ms:.2f} ms into backward")
    print(f"profile: {path}")
    if args.json:
        print(json.dumps(prof.to_dict(), allow_nan=False))
    return 0


# ---- dpscale predict ------------------------------------------------------------------------------


EXAMPLES = """worked examples:
  # a model you describe, on 32 DGX H100 (256 GPUs); every at-scale term on
  dpscale predict --params 1.3e9 --bytes-per-param 2 --step-compute-ms 450 --per-worker-batch 8 \\
      --preset dgx-h100 --world-sizes 8,64,256,1024 --compute-cv 0.02
  # VGG-16 on 4-GPU PCIe servers over 25 GbE RoCE, 128 and 512 GPUs (as Horovod's benchmark)
  dpscale predict --params 138.4e6 --step-compute-ms 416 --per-worker-batch 64 \\
      --preset pcie3-x16+roce-25g --workers-per-node 4 --world-sizes 128,512 --algorithm ring
  # the share of one term: the same with it switched off
  dpscale predict ... --no-stragglers | --no-achieved-bandwidth | --no-congestion | --no-interference
  dpscale predict ... --no-input-pipeline
  # ResNet-50 in mixed precision on one DGX A100 whose host decodes 12000 images/s (measure it:
  # your data loader alone on that node); the step waits for data once 8 GPUs ask for more
  dpscale predict --params 25.6e6 --step-compute-ms 104 --per-worker-batch 256 --preset dgx-a100 \\
      --world-sizes 1,8 --input-samples-per-s 12000
  # or from the data path `dpscale profile` timed, with 8 loader processes per worker (--data-workers)
  dpscale predict --profile mine.json --preset dgx-h100 --data-workers 8
  # a 2:1 oversubscribed fabric beyond 16 nodes per leaf switch
  dpscale predict ... --preset dgx-a100 --oversubscription 2 --nodes-per-switch 16
  # your fabric as nccl-tests measured it: one file per node count (all_reduce_perf's output as printed)
  dpscale predict --params 1.3e9 --step-compute-ms 450 --preset dgx-h100 \\
      --calibrate-from one-node.txt,two-nodes.txt --world-sizes 8,16,64,256
  # in-switch reduction off (NCCL_NVLS_ENABLE=0), or SHARP off on a preset that has it
  dpscale predict ... --preset dgx-h100 --no-nvls | --preset dgx-h100-superpod --no-sharp
  # your own job measured at small N (dpscale scale), carried to larger N
  dpscale predict --from-scale reports/<UTC>-scale --preset cpu-shm --world-sizes 1,2,4,8
  # your model, profiled here (CPU), on this machine's transports
  dpscale profile --model mlp --co-located 2 --out mlp.json
  dpscale bench allreduce --transport gloo,shm --nproc 1,2
  dpscale predict --profile mlp.json --calibrate reports/<UTC>-allreduce --world-sizes 1,2
  # time to a target vs workers and global batch, from a measured noise scale (predict/goodput.py)
  dpscale train --workload digits --nproc 2 --json > run.json
  dpscale predict --goodput --noise-scale run.json --model digits --per-worker-batches 8,32,128
the formulas, their sources and the validation: docs/performance-model.md"""


def add_predict_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EXAMPLES
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_dataclass_arguments(parser, PredictOptions)
    add = parser.add_argument
    add("--json", action="store_true", help="print the predictions as a JSON list on the last line")
    add("--report-dir", default="reports", help="base directory of the report (default reports)")


def scale_terms(opts: PredictOptions) -> ScaleTerms:
    """The at-scale terms from the flags (degrade.py)."""
    cv = opts.compute_cv
    if opts.compute_tail is not None:
        if cv is not None:
            raise ConfigError("--compute-tail: give --compute-cv or --compute-tail, not both")
        cv = cv_from_tail(opts.compute_tail)
    return ScaleTerms(
        stragglers=not opts.no_stragglers,
        compute_cv=cv,
        node_cv=opts.node_cv,
        achieved_bandwidth=not opts.no_achieved_bandwidth,
        congestion=not opts.no_congestion,
        oversubscription=opts.oversubscription,
        nodes_per_switch=opts.nodes_per_switch,
        congestion_per_doubling=opts.congestion_per_doubling,
        overlap_interference=not opts.no_interference,
        interference=opts.interference,
        input_pipeline=not opts.no_input_pipeline,
        input_samples_per_s=opts.input_samples_per_s,
    )


def cpu_profile_on_gpus(profile: profiles.ModelProfile, cluster: Cluster) -> str | None:
    """A warning when a profile measured on a CPU is put on GPU links (None when it is not)."""
    if profile.device != "cpu" or not cluster.gpu:
        return None
    return (
        f"warning: the profile of {profile.model} was measured on a CPU, the cluster ({cluster.name}) has "
        "GPU links: its compute times are a CPU's, so communication will look far cheaper than on GPUs; "
        "give the GPU's step time with --params/--step-compute-ms, or a profile taken on the GPU"
    )


def _from_scale_profile(opts: PredictOptions, run: ScaleRun) -> profiles.ModelProfile:
    """The profile a measured run calibrates: --profile, --params (its step from the run) or the
    report's own; its compute scaled to the run's N = 1 step."""
    if opts.model is not None or opts.step_compute_ms is not None:
        flag = "--model" if opts.model is not None else "--step-compute-ms"
        raise ConfigError(f"{flag}: --from-scale measures the step; give --profile, --params or neither")
    if opts.profile and opts.params is not None:
        raise ConfigError("--params: give --profile or --params with --from-scale, not both")
    if opts.profile:
        prof = profiles.ModelProfile.load(opts.profile)
    elif opts.params is not None:
        prof = profiles.explicit(
            params=round(opts.params),
            bytes_per_param=opts.bytes_per_param,
            step_compute_ms=run.step_ms[1],
            backward_fraction=opts.backward_fraction,
            per_worker_batch=opts.per_worker_batch or DEFAULT_BATCH,
        )
    else:
        prof = report_profile(run)
    return calibrated_compute(prof, run)


def _profile(opts: PredictOptions, run: ScaleRun | None = None):
    if run is not None:
        return _from_scale_profile(opts, run)
    explicit = opts.params is not None or opts.step_compute_ms is not None
    given = [
        f for f, on in (("--profile", opts.profile), ("--model", opts.model), ("--params", explicit)) if on
    ]
    if len(given) > 1:
        raise ConfigError(
            f"{given[1]}: give one of --profile, --model or the explicit numbers, not {' and '.join(given)}"
        )
    batch = opts.per_worker_batch or DEFAULT_BATCH
    if opts.profile:
        return profiles.ModelProfile.load(opts.profile)
    if explicit:
        if opts.params is None or opts.step_compute_ms is None:
            raise ConfigError("--params: explicit numbers need both --params and --step-compute-ms")
        return profiles.explicit(
            params=round(opts.params),
            bytes_per_param=opts.bytes_per_param,
            step_compute_ms=opts.step_compute_ms,
            backward_fraction=opts.backward_fraction,
            per_worker_batch=batch,
        )
    model = opts.model
    if model is None:
        raise ConfigError("--profile: give --profile FILE, --model NAME, or --params and --step-compute-ms")
    print(f"profiling {model} at batch {batch} on one worker ...", flush=True)
    return profiling.measure(model, batch)


def _cluster(opts: PredictOptions) -> Cluster:
    cluster = preset_cluster(opts.preset)
    if opts.workers_per_node is not None:
        cluster = replace(cluster, workers_per_node=opts.workers_per_node)
    # in-switch reduction off first: a calibration then fits the links to the algorithms left
    cluster = replace(
        cluster, nvls=cluster.nvls and not opts.no_nvls, sharp=cluster.sharp and not opts.no_sharp
    )
    if opts.calibrate_from:
        if opts.calibrate:
            raise ConfigError("--calibrate-from: give --calibrate or --calibrate-from, not both")
        files = [f for f in opts.calibrate_from.split(",") if f]
        cluster = calibrated_from(cluster, read_measurements(files, transport=opts.transport))
    elif opts.calibrate:
        results = load_allreduce_report(opts.calibrate)
        have = list(dict.fromkeys(p["transport"] for p in results["points"]))
        transport = opts.transport or ("shm" if "shm" in have else have[0])
        cluster = calibrated(cluster, results, transport)
    elif opts.transport:
        raise ConfigError("--transport: only meaningful with --calibrate or --calibrate-from")
    intra, inter = cluster.intra, cluster.inter
    if any(v is not None for v in (opts.intra_bw_GBps, opts.intra_lat_us, opts.intra_efficiency)):
        intra = replace(
            intra,
            bandwidth_GBps=_positive("--intra-bw-GBps", opts.intra_bw_GBps, intra.bandwidth_GBps),
            latency_us=_nonnegative("--intra-lat-us", opts.intra_lat_us, intra.latency_us),
            efficiency=_fraction("--intra-efficiency", opts.intra_efficiency, intra.efficiency),
        )
    if any(v is not None for v in (opts.inter_bw_Gbps, opts.inter_lat_us, opts.inter_efficiency)):
        bw = None if opts.inter_bw_Gbps is None else opts.inter_bw_Gbps / 8
        inter = replace(
            inter,
            bandwidth_GBps=_positive("--inter-bw-Gbps", bw, inter.bandwidth_GBps),
            latency_us=_nonnegative("--inter-lat-us", opts.inter_lat_us, inter.latency_us),
            efficiency=_fraction("--inter-efficiency", opts.inter_efficiency, inter.efficiency),
        )
    overhead = opts.per_message_overhead_us
    custom = intra is not cluster.intra or inter is not cluster.inter or overhead is not None
    return replace(
        cluster,
        intra=intra,
        inter=inter,
        per_message_overhead_us=cluster.per_message_overhead_us if overhead is None else overhead,
        name=cluster.name + (" with flags" if custom else ""),
    )


def _fraction(flag: str, value: float | None, default: float) -> float:
    if value is not None and not 0 < value <= 1:
        raise ConfigError(f"{flag}: an achieved fraction of the nominal rate, in (0, 1], got {value}")
    return default if value is None else value


def _positive(flag: str, value: float | None, default: float) -> float:
    if value is not None and not value > 0:
        raise ConfigError(f"{flag}: must be > 0, got {value}")
    return default if value is None else value


def _nonnegative(flag: str, value: float | None, default: float) -> float:
    if value is not None and value < 0:
        raise ConfigError(f"{flag}: must be >= 0, got {value}")
    return default if value is None else value


def world_sizes_for(opts: PredictOptions, cluster: Cluster) -> list[int]:
    """--world-sizes, or --nodes N alone (N x workers per node), or 1, 2, 4, ... up to 1024."""
    g = cluster.workers_per_node
    if opts.nodes is not None:
        if opts.world_sizes:
            raise ConfigError("--nodes: give --nodes or --world-sizes, not both")
        if opts.nodes < 1:
            raise ConfigError(f"--nodes: must be >= 1, got {opts.nodes}")
        return [opts.nodes * g]
    if opts.world_sizes:
        return parse_int_list(opts.world_sizes, flag="--world-sizes", minimum=1)
    within = [1 << k for k in range(g.bit_length()) if 1 << k < g]
    return within + [g << k for k in range(MAX_DEFAULT_WORLD.bit_length()) if g << k <= MAX_DEFAULT_WORLD]


def _goodput_inputs(opts: PredictOptions) -> tuple[goodput.NoiseScaleSource, float, float]:
    """(noise scale source, steps to target, at global batch), checked before any profiling."""
    if opts.noise_scale is None:
        raise ConfigError("--goodput needs --noise-scale: a number, or a `dpscale train --json` summary")
    source = goodput.load_noise_scale(opts.noise_scale)
    steps = opts.target_steps if opts.target_steps is not None else source.steps
    batch = opts.target_batch if opts.target_batch is not None else source.global_batch
    if steps is None or batch is None:
        raise ConfigError(
            "--target-steps: say how many steps a run took to the target and at which --target-batch "
            "(a train summary given to --noise-scale supplies both)"
        )
    goodput.s_min_from_run(steps, batch, source.noise_scale)  # checks both are > 0
    return source, float(steps), float(batch)


def _run_goodput(
    opts: PredictOptions, prof, cluster: Cluster, config: PredictConfig, *, json_out: bool
) -> int:
    source, steps, batch = _goodput_inputs(opts)
    batches = (
        parse_int_list(opts.per_worker_batches, flag="--per-worker-batches", minimum=1)
        if opts.per_worker_batches
        else [config.per_worker_batch or prof.per_worker_batch]
    )
    # each batch is a prediction of its own: the one-call bound holds for all of them together
    check_bounds(prof, config, batches=len(batches))
    step_ms = {}
    for b in batches:
        for p in predict(prof, cluster, replace(config, per_worker_batch=b)):
            step_ms[(p.world_size, b)] = p.step_ms
    s_min = goodput.s_min_from_run(steps, batch, source.noise_scale)
    points = goodput.goodput_points(step_ms, s_min=s_min, noise_scale=source.noise_scale)
    print(render.profile_summary(prof))
    print(f"cluster {cluster.describe()}")
    print(
        f"noise scale from {source.source}; the target (what that run reached) took {steps:,.0f} steps "
        f"at global batch {batch:,.0f}"
    )
    print(goodput.format_table(points))
    print(goodput.summary(points, source.noise_scale, s_min))
    if json_out:
        print(json.dumps([p.to_dict() for p in points], allow_nan=False))
    return 0


def run_predict_from_args(args: argparse.Namespace) -> int:
    require_plots("predict")
    opts = PredictOptions(**dataclass_kwargs(args, PredictOptions))
    # a measured run is read (and refused if it does not read) before anything else is done
    run = read_scale_report(opts.from_scale, opts.engine) if opts.from_scale else None
    cluster = _cluster(opts)
    if opts.goodput:
        _goodput_inputs(opts)  # bad goodput input fails before a profile is measured
    config = PredictConfig(
        world_sizes=world_sizes_for(opts, cluster),
        per_worker_batch=opts.per_worker_batch,
        bucket_mb=opts.bucket_mb,
        overlap=not opts.no_overlap,
        compression=opts.compression,
        algorithm=opts.algorithm,
        engine=opts.engine,
        contention=opts.contention,
        data_workers=opts.data_workers,
        terms=scale_terms(opts),
        # the in-step sync terms of the transport the cluster was calibrated for (predict/sync.py)
        sync_transport=next(iter(cluster.measured.values())).transport if cluster.measured else None,
    )
    for n in config.world_sizes:
        cluster.layout(n)  # bad world sizes fail before a profile is measured
    check_writable_dir("--report-dir", args.report_dir)  # and where the report goes
    prof = _profile(opts, run)
    if run is not None:
        cluster = calibrated_fabric(prof, cluster, config, run)
    if warning := cpu_profile_on_gpus(prof, cluster):
        print(warning, file=sys.stderr)
    if config.compression > 1 and not cluster.gpu:
        # CPU workers cast on their own cores: at this host's measured rates (compression_cost.py)
        staged = "shm" in cluster.name or any(m.transport == "shm" for m in cluster.measured.values())
        cost = compression_cost.measure(prof.threads or 1, staged=staged)
        config = replace(config, compression_cost=cost)
    if opts.goodput:
        return _run_goodput(opts, prof, cluster, config, json_out=args.json)
    predictions = predict(prof, cluster, config)
    print(render.profile_summary(prof))
    print(f"cluster {cluster.describe()}")
    print(render.format_table(predictions))
    report = ReportDir.create(args.report_dir, "predict")
    render.write_report(report, predictions, prof, cluster, config)
    print(f"report: {report.path}")
    if args.json:
        print(json.dumps([p.to_dict() for p in predictions], allow_nan=False))
    return 0
