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

from ..bench.args import parse_int_list
from ..bench.report import ReportDir
from ..errors import ConfigError
from ..flags import add_dataclass_arguments, dataclass_kwargs
from . import goodput, render
from . import profile as profiles
from .cluster import (
    CLUSTER_PRESETS,
    LINK_PRESETS,
    Cluster,
    calibrated,
    load_allreduce_report,
    preset_cluster,
)
from .costs import ALGORITHM_CHOICES
from .degrade import ScaleTerms, cv_from_tail
from .model import ENGINE_CHOICES, PredictConfig, predict

DEFAULT_BATCH = 64
MAX_DEFAULT_WORLD = 1024

# ---- dpscale profile ------------------------------------------------------------------------------


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(parser, profiles.ProfileConfig)
    parser.add_argument(
        "--json", action="store_true", help="print the profile as JSON on the last line of stdout"
    )


def run_profile_from_args(args: argparse.Namespace) -> int:
    config = profiles.ProfileConfig(**dataclass_kwargs(args, profiles.ProfileConfig))
    prof = profiles.measure(
        config.model,
        config.per_worker_batch,
        steps=config.steps,
        warmup=config.warmup,
        threads=config.threads,
        co_located=config.co_located,
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
  # a 2:1 oversubscribed fabric beyond 16 nodes per leaf switch
  dpscale predict ... --preset dgx-a100 --oversubscription 2 --nodes-per-switch 16
  # your model, profiled here (CPU), on this machine's transports
  dpscale profile --model mlp --co-located 2 --out mlp.json
  dpscale bench allreduce --transport gloo,shm --world-sizes 1,2
  dpscale predict --profile mlp.json --calibrate reports/<UTC>-allreduce --world-sizes 1,2
  # time to a target vs workers and global batch, from a measured noise scale (predict/goodput.py)
  dpscale train --workload digits --nproc 2 --json > run.json
  dpscale predict --goodput --noise-scale run.json --model digits --per-worker-batches 8,32,128
the formulas, their sources and the validation: docs/performance-model.md"""


def add_predict_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EXAMPLES
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add = parser.add_argument
    g = parser.add_argument_group("model (one of: --profile, --model, or the explicit numbers)")
    g.add_argument("--profile", default=None, help="a `dpscale profile` JSON file")
    g.add_argument(
        "--model",
        default=None,
        help="a built-in workload or module:callable (a Task), profiled now on one worker",
    )
    g.add_argument("--params", type=float, default=None, help="explicit: parameter count (e.g. 25.6e6)")
    g.add_argument(
        "--bytes-per-param", type=float, default=4.0, help="explicit: gradient bytes each (default 4)"
    )
    g.add_argument("--step-compute-ms", type=float, default=None, help="explicit: one worker's step, ms")
    g.add_argument("--backward-fraction", type=float, default=2 / 3, help="explicit: share of backward (2/3)")
    add(
        "--per-worker-batch",
        type=int,
        default=None,
        help=f"default: the profile's ({DEFAULT_BATCH} otherwise)",
    )
    c = parser.add_argument_group("cluster (a preset, flags overriding it, or a calibration)")
    presets = ", ".join([*CLUSTER_PRESETS, *LINK_PRESETS])
    c.add_argument(
        "--preset", default="cpu-shm", help=f"{presets}, or INTRA+INTER, e.g. pcie3-x16+8xib-hdr200"
    )
    c.add_argument("--workers-per-node", type=int, default=None, help="default: the preset's")
    c.add_argument("--nodes", type=int, default=None, help="one world size: nodes x workers per node")
    c.add_argument(
        "--intra-bw-GBps", type=float, default=None, help="intra-node bandwidth per direction, GB/s"
    )
    c.add_argument("--intra-lat-us", type=float, default=None, help="intra-node latency per step, us")
    c.add_argument(
        "--intra-efficiency", type=float, default=None, help="achieved / nominal intra-node rate (calibrate)"
    )
    c.add_argument(
        "--inter-efficiency", type=float, default=None, help="achieved / nominal inter-node rate (calibrate)"
    )
    c.add_argument("--inter-bw-Gbps", type=float, default=None, help="inter-node bandwidth per node, Gbit/s")
    c.add_argument("--inter-lat-us", type=float, default=None, help="inter-node latency per step, us")
    c.add_argument("--per-message-overhead-us", type=float, default=None, help="software cost per call, us")
    c.add_argument("--calibrate", default=None, help="a `dpscale bench allreduce` report directory")
    c.add_argument(
        "--transport", default=None, help="which transport of --calibrate (default shm, else first)"
    )
    add("--world-sizes", default=None, help="comma-separated (default 1,2,4,... up to 1024)")
    add("--bucket-mb", type=float, default=25.0, help="bucket cap in MiB (default 25; the first is 1)")
    add(
        "--algorithm", default="auto", help=f"{', '.join(ALGORITHM_CHOICES)} (default auto: fastest per size)"
    )
    add("--no-overlap", action="store_true", help="reduce only after backward has finished")
    add("--compression", type=float, default=1.0, help="gradient bytes / bytes on the wire (2 = fp16)")
    add("--engine", default="dpscale", help=f"whose measured overhead to add: {', '.join(ENGINE_CHOICES)}")
    add(
        "--contention",
        type=float,
        default=None,
        help="compute slowdown when workers share a node (default: the profile's --co-located, else 1)",
    )
    t = parser.add_argument_group("at-scale terms (docs/performance-model.md; each can be switched off)")
    t.add_argument("--no-stragglers", action="store_true", help="no waiting for the slowest worker")
    t.add_argument(
        "--compute-cv",
        type=float,
        default=None,
        help="std/mean of a worker's step compute (default: the profile's, else the preset's)",
    )
    t.add_argument("--compute-tail", type=float, default=None, help="or: p99/median of it (Gaussian)")
    t.add_argument(
        "--node-cv",
        type=float,
        default=None,
        help="std/mean of the delay a node's host and network add to its workers (default: the preset's)",
    )
    t.add_argument("--no-achieved-bandwidth", action="store_true", help="links at their nominal rate")
    t.add_argument("--no-congestion", action="store_true", help="no oversubscription or flow collisions")
    t.add_argument("--oversubscription", type=float, default=1.0, help="fabric uplink ratio (2 = 2:1)")
    t.add_argument("--nodes-per-switch", type=int, default=None, help="nodes non-blocking below one switch")
    t.add_argument(
        "--congestion-per-doubling",
        type=float,
        default=None,
        help="inter-node bandwidth lost per doubling of the nodes (default: the preset's)",
    )
    t.add_argument("--no-interference", action="store_true", help="backward not slowed by reductions")
    t.add_argument(
        "--interference",
        type=float,
        default=None,
        help="backward slowdown per ms of communication it hides (default: the preset's)",
    )
    gp = parser.add_argument_group("goodput (time to a target; predict/goodput.py)")
    gp.add_argument(
        "--goodput", action="store_true", help="rank (workers, global batch) by predicted time to target"
    )
    gp.add_argument(
        "--noise-scale",
        default=None,
        help="B_simple in samples, a `dpscale train --json` summary file, or a metrics.jsonl (its last gns)",
    )
    gp.add_argument(
        "--target-steps", type=float, default=None, help="steps a run took to the target (default: the run's)"
    )
    gp.add_argument(
        "--target-batch", type=int, default=None, help="that run's global batch (default: the run's)"
    )
    gp.add_argument(
        "--per-worker-batches", default=None, help="comma-separated (default: the per-worker batch alone)"
    )
    add("--json", action="store_true", help="print the predictions as a JSON list on the last line")
    add("--report-dir", default="reports", help="base directory of the report (default reports)")


def scale_terms(args: argparse.Namespace) -> ScaleTerms:
    """The at-scale terms from the flags (degrade.py)."""
    cv = args.compute_cv
    if args.compute_tail is not None:
        if cv is not None:
            raise ConfigError("--compute-tail: give --compute-cv or --compute-tail, not both")
        cv = cv_from_tail(args.compute_tail)
    return ScaleTerms(
        stragglers=not args.no_stragglers,
        compute_cv=cv,
        node_cv=args.node_cv,
        achieved_bandwidth=not args.no_achieved_bandwidth,
        congestion=not args.no_congestion,
        oversubscription=args.oversubscription,
        nodes_per_switch=args.nodes_per_switch,
        congestion_per_doubling=args.congestion_per_doubling,
        overlap_interference=not args.no_interference,
        interference=args.interference,
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


def _profile(args: argparse.Namespace):
    explicit = args.params is not None or args.step_compute_ms is not None
    given = [
        f for f, on in (("--profile", args.profile), ("--model", args.model), ("--params", explicit)) if on
    ]
    if len(given) > 1:
        raise ConfigError(
            f"{given[1]}: give one of --profile, --model or the explicit numbers, not {' and '.join(given)}"
        )
    batch = args.per_worker_batch or DEFAULT_BATCH
    if args.profile:
        return profiles.ModelProfile.load(args.profile)
    if explicit:
        if args.params is None or args.step_compute_ms is None:
            raise ConfigError("--params: explicit numbers need both --params and --step-compute-ms")
        return profiles.explicit(
            params=round(args.params),
            bytes_per_param=args.bytes_per_param,
            step_compute_ms=args.step_compute_ms,
            backward_fraction=args.backward_fraction,
            per_worker_batch=batch,
        )
    model = args.model
    if model is None:
        raise ConfigError("--profile: give --profile FILE, --model NAME, or --params and --step-compute-ms")
    print(f"profiling {model} at batch {batch} on one worker ...", flush=True)
    return profiles.measure(model, batch)


def _cluster(args: argparse.Namespace) -> Cluster:
    cluster = preset_cluster(args.preset)
    if args.workers_per_node is not None:
        cluster = replace(cluster, workers_per_node=args.workers_per_node)
    if args.calibrate:
        results = load_allreduce_report(args.calibrate)
        have = list(dict.fromkeys(p["transport"] for p in results["points"]))
        transport = args.transport or ("shm" if "shm" in have else have[0])
        cluster = calibrated(cluster, results, transport)
    elif args.transport:
        raise ConfigError("--transport: only meaningful with --calibrate")
    intra, inter = cluster.intra, cluster.inter
    if any(v is not None for v in (args.intra_bw_GBps, args.intra_lat_us, args.intra_efficiency)):
        intra = replace(
            intra,
            bandwidth_GBps=_positive("--intra-bw-GBps", args.intra_bw_GBps, intra.bandwidth_GBps),
            latency_us=_nonnegative("--intra-lat-us", args.intra_lat_us, intra.latency_us),
            efficiency=_fraction("--intra-efficiency", args.intra_efficiency, intra.efficiency),
        )
    if any(v is not None for v in (args.inter_bw_Gbps, args.inter_lat_us, args.inter_efficiency)):
        bw = None if args.inter_bw_Gbps is None else args.inter_bw_Gbps / 8
        inter = replace(
            inter,
            bandwidth_GBps=_positive("--inter-bw-Gbps", bw, inter.bandwidth_GBps),
            latency_us=_nonnegative("--inter-lat-us", args.inter_lat_us, inter.latency_us),
            efficiency=_fraction("--inter-efficiency", args.inter_efficiency, inter.efficiency),
        )
    overhead = args.per_message_overhead_us
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


def world_sizes_for(args: argparse.Namespace, cluster: Cluster) -> list[int]:
    """--world-sizes, or --nodes N alone (N x workers per node), or 1, 2, 4, ... up to 1024."""
    g = cluster.workers_per_node
    if args.nodes is not None:
        if args.world_sizes:
            raise ConfigError("--nodes: give --nodes or --world-sizes, not both")
        if args.nodes < 1:
            raise ConfigError(f"--nodes: must be >= 1, got {args.nodes}")
        return [args.nodes * g]
    if args.world_sizes:
        return parse_int_list(args.world_sizes, flag="--world-sizes", minimum=1)
    within = [1 << k for k in range(g.bit_length()) if 1 << k < g]
    return within + [g << k for k in range(MAX_DEFAULT_WORLD.bit_length()) if g << k <= MAX_DEFAULT_WORLD]


def _goodput_inputs(args: argparse.Namespace) -> tuple[goodput.NoiseScaleSource, float, float]:
    """(noise scale source, steps to target, at global batch), checked before any profiling."""
    if args.noise_scale is None:
        raise ConfigError("--goodput needs --noise-scale: a number, or a `dpscale train --json` summary")
    source = goodput.load_noise_scale(args.noise_scale)
    steps = args.target_steps if args.target_steps is not None else source.steps
    batch = args.target_batch if args.target_batch is not None else source.global_batch
    if steps is None or batch is None:
        raise ConfigError(
            "--target-steps: say how many steps a run took to the target and at which --target-batch "
            "(a train summary given to --noise-scale supplies both)"
        )
    goodput.s_min_from_run(steps, batch, source.noise_scale)  # checks both are > 0
    return source, float(steps), float(batch)


def _run_goodput(args: argparse.Namespace, prof, cluster: Cluster, config: PredictConfig) -> int:
    source, steps, batch = _goodput_inputs(args)
    batches = (
        parse_int_list(args.per_worker_batches, flag="--per-worker-batches", minimum=1)
        if args.per_worker_batches
        else [config.per_worker_batch or prof.per_worker_batch]
    )
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
    if args.json:
        print(json.dumps([p.to_dict() for p in points], allow_nan=False))
    return 0


def run_predict_from_args(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    if args.goodput:
        _goodput_inputs(args)  # bad goodput input fails before a profile is measured
    config = PredictConfig(
        world_sizes=world_sizes_for(args, cluster),
        per_worker_batch=args.per_worker_batch,
        bucket_mb=args.bucket_mb,
        overlap=not args.no_overlap,
        compression=args.compression,
        algorithm=args.algorithm,
        engine=args.engine,
        contention=args.contention,
        terms=scale_terms(args),
        # the in-step sync terms of the transport the cluster was calibrated for (predict/sync.py)
        sync_transport=next(iter(cluster.measured.values())).transport if cluster.measured else None,
    )
    for n in config.world_sizes:
        cluster.layout(n)  # bad world sizes fail before a profile is measured
    prof = _profile(args)
    if warning := cpu_profile_on_gpus(prof, cluster):
        print(warning, file=sys.stderr)
    if args.goodput:
        return _run_goodput(args, prof, cluster, config)
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
