"""Old vs new engine against torch DDP, each in a fresh interpreter of its own, at world size 1.

    python benchmarks/engine_fresh_ab.py --base REF [--models mlp,transformer] [--rounds 6] [--steps 40]

A training job runs one model in a process it started: the allocator's state and the caches
hold that model's tensors alone. engine_ab.py times its variants in one process (where one
variant's freed blocks are the next one's) or in ranks forked from a server (which inherit its
allocator state); here every (round, variant) is a new `python` process, as torchrun starts
workers, the variants (`torch`, `base`: dpscale at git REF, `head`: this tree) rotating each round.
A process builds the recipe's model (seed 0), wraps it as engine_ab's --base variants (bucket_cap_mb
25, gradient_as_bucket_view=True, gloo, one intra-op thread), warms up, then times `--steps`
steps (zero_grad + forward + loss + backward + SGD step); its figure is the median step. Printed:
per variant the median over rounds, the ratio to torch's in the same round (median, p10-p90), and
head / base. Minor page faults per step are printed beside.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = ("torch", "base", "head")
HERE = Path(__file__).resolve().parent


def child(variant: str, model: str, steps: int, base_dir: str) -> None:
    import resource

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    sys.path.insert(0, base_dir)
    from engine_ab import PER_WORKER_BATCH, built_variant, rank_batch

    from dpscale.lab.bench.scaling_rank import timed_step
    from dpscale.lab.recipe import load_recipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    work = load_recipe(model)
    x, y = rank_batch(work, 0)
    ddp, opt = built_variant(variant, work, "gloo", True)
    for _ in range(max(3, steps // 5)):
        timed_step(ddp, opt, work.loss, x, y, PER_WORKER_BATCH)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times = [timed_step(ddp, opt, work.loss, x, y, PER_WORKER_BATCH) for _ in range(steps)]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    if variant != "torch":
        ddp.close()
    dist.destroy_process_group()
    print(json.dumps({"step_ms": statistics.median(times), "faults": faults / steps}))


def p10_p90(values: list[float]) -> str:
    d = statistics.quantiles(values, n=10)
    return f"{statistics.median(values):.3f} ({d[0]:.3f}-{d[-1]:.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git ref of the engine to compare with")
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        variant, model, steps, base_dir = args.child
        child(variant, model, int(steps), base_dir)
        return
    if args.rounds < 3 or args.steps < 3:
        parser.error("--rounds must be >= 3 and --steps >= 3")
    sys.path.insert(0, str(HERE))
    from engine_ab import extract_base

    with tempfile.TemporaryDirectory(prefix="engine-fresh-ab-") as tmp:
        extract_base(args.base, Path(tmp))
        for model in (m.strip() for m in args.models.split(",") if m.strip()):
            steps = args.steps if model == "mlp" else max(3, args.steps // 5)
            got: dict[str, list[dict]] = {v: [] for v in VARIANTS}
            for k in range(args.rounds):
                for v in VARIANTS[k % 3 :] + VARIANTS[: k % 3]:
                    cmd = [sys.executable, __file__, "--base", args.base, "--child", v, model, str(steps)]
                    cmd.append(tmp)
                    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                    got[v].append(json.loads(out.strip().splitlines()[-1]))
            print(f"{model}: {args.rounds} rounds, {steps} steps a process, world size 1, gloo")
            ms = {v: [r["step_ms"] for r in got[v]] for v in VARIANTS}
            for v in VARIANTS:
                ratio = p10_p90([a / t for a, t in zip(ms[v], ms["torch"], strict=True)])
                faults = statistics.median(r["faults"] for r in got[v])
                median = statistics.median(ms[v])
                print(f"  {v:5s} {median:8.2f} ms  /torch {ratio}  faults/step {faults:.0f}")
            print(f"  head / base {p10_p90([h / b for h, b in zip(ms['head'], ms['base'], strict=True)])}")


if __name__ == "__main__":
    main()
