"""Time bounds for the tests that measure time, so that they hold on a busy host (issue #34).

A bound is what the test checks (a wait or timeout it set) plus a margin in multiples of a baseline
measured on this host at the time of the test, never a fixed number of seconds: a host at load 4 is
slower at everything, the margin included. Where the behaviour under test is "did not wait", the
wait it must not do is set long (a minute) and the bound stays far below it.

- `cpu_baseline_s()`: a fixed piece of Python work (~10 ms on a quiet 2-core host), for margins that
  cover thread scheduling in one process.
- `process_baseline_s()`: starting a Python that imports what a rank of dpscale's command line
  imports (the CLI, the trainer, the engine, the launcher, the lab's harness; ~3 s quiet), for
  margins that cover starting, stopping or killing processes; `process_baseline_once_s()` is the
  same measured once per test process, for polls that end as soon as their condition holds.
"""

import functools
import statistics
import subprocess
import sys
import time

_HEAVY_IMPORTS = (
    "import dpscale.cli.main, dpscale.engine, dpscale.train.trainer, dpscale.launch.launcher, "
    "dpscale.lab.multirank, dpscale.lab.bench.bench"
)


def _work() -> int:
    return sum(i * i for i in range(100_000))


def cpu_baseline_s(runs: int = 5) -> float:
    """Median seconds of a fixed piece of Python work, measured now."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        _work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def process_baseline_s() -> float:
    """Seconds to start a Python that imports what a rank of dpscale's command line imports, and
    exit, measured now. `import dpscale.cli.main` alone is lazy (~0.2 s, torch not loaded): too
    small a unit for margins that cover starting ranks, so the heavy modules are named here."""
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", _HEAVY_IMPORTS], check=True, timeout=600)
    return time.monotonic() - start


@functools.cache
def process_baseline_once_s() -> float:
    """`process_baseline_s()` measured the first time it is asked for in this test process."""
    return process_baseline_s()
