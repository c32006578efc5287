"""How long after its start a SIGTERM still kills `dpscale train` silently (issue #34).

For each source tree given, the installed command's start as pip's console script does it (the
tree's [project.scripts] entry point imported and called) is timed from Popen's return (the child
has exec'd) to the moment its main thread holds or catches SIGTERM (/proc/PID/status SigBlk or
SigCgt); the reference is a Python whose first line holds SIGTERM: the interpreter's own start, the
part no code can close. The sides alternate run by run; printed: each side's median in ms and its
ratio to the reference's (median of the per-round ratios, with the 10th-90th percentiles).

    python benchmarks/archive/signal_window.py --rounds 30 . /path/to/an/older/tree

Each command is killed with its process group as soon as it is protected, in a temp dir of its own
that is removed after. Results: docs/fault-tolerance.md, "Signals in a command's first moments".
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ARGS = ["train", "--nproc", "2", "--workload", "synthetic", "--max-steps", "5"]
REFERENCE = (
    "import _signal\n_signal.pthread_sigmask(_signal.SIG_BLOCK, [_signal.SIGTERM])\nimport time\ntime.sleep(60)"
)


def protected(pid: int) -> bool | None:
    """Whether `pid` holds or catches SIGTERM; None once it is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    masks = [int(line.split()[1], 16) for line in lines if line.startswith(("SigBlk:", "SigCgt:"))]
    return any(mask >> (signal.SIGTERM - 1) & 1 for mask in masks)


def time_to_protected_ms(command: list[str], src: str | None) -> float:
    tmp = tempfile.mkdtemp(prefix="signal-window-")
    env = dict(os.environ, TMPDIR=tmp)
    if src is not None:
        env["PYTHONPATH"] = src
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    start = time.perf_counter()
    while not (state := protected(proc.pid)) and proc.poll() is None and state is not None:
        pass  # a busy look: a sleep's granularity is of the order of what is measured
    took = (time.perf_counter() - start) * 1000 if state else float("nan")
    os.killpg(proc.pid, signal.SIGKILL)  # the command and the workers' server it may have started
    proc.wait()
    time.sleep(0.05)
    shutil.rmtree(tmp, ignore_errors=True)
    return took


def entry_command(tree: Path) -> list[str]:
    target = tomllib.loads((tree / "pyproject.toml").read_text())["project"]["scripts"]["dpscale"]
    module, function = target.split(":")
    return [sys.executable, "-c", f"import sys\nfrom {module} import {function}\nsys.exit({function}())", *ARGS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", type=Path, help="source trees (each with pyproject.toml and src/)")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    sides: dict[str, tuple[list[str], str | None]] = {"interpreter": ([sys.executable, "-c", REFERENCE], None)}
    for tree in args.trees:
        sides[str(tree)] = (entry_command(tree.resolve()), str(tree.resolve() / "src"))
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, (command, src) in sides.items():
            times[name].append(time_to_protected_ms(command, src))
    for name, values in times.items():
        ratios = sorted(a / b for a, b in zip(values, times["interpreter"], strict=True))
        low, high = ratios[len(ratios) // 10], ratios[(len(ratios) - 1) * 9 // 10]
        print(
            f"{name}: median {statistics.median(values):.1f} ms, "
            f"{statistics.median(ratios):.2f}x the interpreter's start [{low:.2f}-{high:.2f}]"
        )


if __name__ == "__main__":
    main()
