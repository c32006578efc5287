"""Engine benchmark entry point: `python benchmarks/engine.py [--models mlp,transformer]`.

See dpscale/lab/bench/engines.py for the protocol; figures are recorded in BENCHMARKS.md.
"""

from dpscale.cli.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
