"""How far a predicted efficiency can be trusted: the method's measured error on held-out cases.

benchmarks/predict_error_band.py reproduces the published study (docs/performance-model.md,
"Published results": parameters fitted on the training half, the split fixed before any result was
seen), takes the smallest and the largest held-out error (predicted - published, points) and stores
them in error_band.json beside this file, with the held-out cases they came from. A prediction of
efficiency e is then shown with the band [e - high, e - low]: where the published efficiency of
every held-out case lay relative to its prediction. For a new case like them the chance of falling
inside is (n - 1) / (n + 1) (`coverage`; the split-conformal argument, see that script). It is one
band for every N and cluster (the cases span 4-1024 GPUs); one worker's efficiency is 1 by
definition and carries none.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

BAND_FILE = Path(__file__).resolve().parent / "error_band.json"


@dataclass(frozen=True)
class ErrorBand:
    error_low_points: float  # the smallest held-out predicted - published, points
    error_high_points: float  # the largest
    coverage: float  # chance a new case like the held-out ones falls inside: (n - 1) / (n + 1)
    held_out_cases: int

    def around(self, efficiency: float, world_size: int) -> tuple[float, float]:
        """(low, high) efficiency the band gives a prediction; (e, e) for one worker."""
        if world_size == 1:
            return efficiency, efficiency
        low = max(0.0, efficiency - self.error_high_points / 100)
        high = min(max(1.0, efficiency), efficiency - self.error_low_points / 100)
        return low, high

    def describe(self) -> str:
        return (
            f"all {self.held_out_cases} held-out published cases lay within "
            f"{-self.error_high_points:+.1f} to {-self.error_low_points:+.1f} points of their "
            f"prediction (a new case like them: {self.coverage:.0%})"
        )


@functools.cache
def error_band() -> ErrorBand:
    """The stored band (read once per process)."""
    doc = json.loads(BAND_FILE.read_text())
    return ErrorBand(
        error_low_points=float(doc["error_low_points"]),
        error_high_points=float(doc["error_high_points"]),
        coverage=float(doc["coverage"]),
        held_out_cases=int(doc["held_out_cases"]),
    )
