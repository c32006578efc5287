"""Engine benchmark entry point: `python benchmarks/engine.py [--models mlp,transformer]`.

See dpscale/bench/engine.py for the protocol; figures are recorded in BENCHMARKS.md.
"""

from dpscale.lab.bench.commands import main

if __name__ == "__main__":
    raise SystemExit(main(name="engine"))
