"""The third check of `dpscale predict`: published data-parallel results at 8 to 1024 GPUs
(docs/performance-model.md, "Published results"). Pure computation, a few seconds with the fit.

    python benchmarks/archive/predict_published.py

Prints the held-out table (markdown): free parameters fitted on the training half of the cases
(published.py), the error on the held-out half, each case's source, then the cases collected after
those results were known (published_posthoc.py), predicted with the same fit.
"""

from __future__ import annotations

import sys

import published
import published_cases
import published_posthoc


def main() -> int:
    study = published.held_out_study()
    print(published.format_study(study))
    for case in published_cases.cases():
        print(f"\n- {case.name}: {case.source}. {case.notes}")
    # collected after the held-out results were known: predicted with the training half's fit only
    print("\ncases collected after the held-out results (published_posthoc.py), with the same fit:\n")
    print(published_posthoc.format_posthoc(published_posthoc.posthoc_study(study.params)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
