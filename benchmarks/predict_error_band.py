"""The error band of `dpscale predict`: the method's measured error on held-out published cases.

    python benchmarks/predict_error_band.py [--write]

Reproduces the published study (benchmarks/archive/published*.py: parameters fitted on the training
half, the split fixed before any result was seen; docs/performance-model.md, "Published results"),
takes the errors (predicted - published efficiency, in points) of the held-out half, and prints the
band the rule below gives, with how many held-out and post-hoc cases it covers. --write stores it in
src/dpscale/lab/predict/error_band.json, which `dpscale predict` reads (predict/error_band.py).

The rule (fixed by issue #33 before this script first ran): the central 90% interval of the
held-out errors, the 5th and 95th percentiles with linear interpolation between order statistics
(`statistics.quantiles(..., n=20, method="inclusive")`). The post-hoc cases (collected after the
held-out results were known) are not used for the band; its coverage of them is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "archive"))  # the published study lives there (archived research)

import published  # noqa: E402
import published_posthoc  # noqa: E402

OUT = ROOT.parent / "src" / "dpscale" / "lab" / "predict" / "error_band.json"
COVERAGE = 0.90


def band(errors: list[float]) -> tuple[float, float]:
    """(5th, 95th) percentile of the errors, points."""
    q = statistics.quantiles(errors, n=20, method="inclusive")
    return q[0], q[-1]


def covered(errors: list[float], low: float, high: float) -> int:
    return sum(low <= e <= high for e in errors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write", action="store_true", help=f"store the band in {OUT.relative_to(ROOT.parent)}"
    )
    args = parser.parse_args(argv)
    study = published.held_out_study(published.FITTED)
    held = study.errors(held_out=True)
    posthoc = published_posthoc.posthoc_study(study.params).errors
    low, high = band(held)
    doc = {
        "coverage": COVERAGE,
        "error_low_points": round(low, 2),
        "error_high_points": round(high, 2),
        "held_out_cases": len(held),
        "rule": "5th-95th percentile of predicted - published efficiency on the held-out published cases",
        "source": "benchmarks/predict_error_band.py over benchmarks/archive/published_cases.py",
    }
    print(f"held-out errors (points): {', '.join(f'{e:+.1f}' for e in sorted(held))}")
    print(f"band: error in [{low:+.2f}, {high:+.2f}] points ({COVERAGE:.0%} interval of {len(held)} cases)")
    print(f"covers {covered(held, low, high)}/{len(held)} held-out cases (the ones it was taken from)")
    print(f"covers {covered(posthoc, low, high)}/{len(posthoc)} post-hoc cases (not used for it)")
    within = sum(abs(e) <= 5 for e in held)
    print(f"held out within 5 points: {within}/{len(held)}, worst {max(map(abs, held)):.1f}")
    if args.write:
        OUT.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"written: {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
