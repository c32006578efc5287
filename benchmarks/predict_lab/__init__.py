"""Checks of `dpscale predict` against measurement (benchmarks/predict_validation.py, tests/lab/predict).

Not part of the installed package (nothing at run time needs it):

- `validate`: a `dpscale bench scaling` report of this machine, predicted from a profile of another run.
- `emulate`, `emulate_worker`, `emulate_validate`: an emulated multi-host cluster (network namespaces).
- The published cases and their fit are archived (benchmarks/archive/predict_published.py).

Tests import it with benchmarks/ on sys.path (tests/lab/predict/conftest.py).
"""
