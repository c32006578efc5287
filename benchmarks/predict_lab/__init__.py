"""Checks of `dpscale predict` against measurement (benchmarks/predict_validation.py, tests/lab/predict).

Not part of the installed package (nothing at run time needs it):

- `validate`: a `dpscale bench scaling` report of this machine, predicted from a profile of another run.
- `emulate`, `emulate_worker`, `emulate_validate`: an emulated multi-host cluster (network namespaces).
- `published_case` (one published result and its prediction), `published_cases` (the cited results at
  8 to 1024 GPUs and the split rule), `published` (free parameters fitted on the training half, the
  error reported on the held-out half); `published_posthoc`: cases collected after those results
  were known, predicted with the same fit and reported apart.

Tests import it with benchmarks/ on sys.path (tests/lab/predict/conftest.py).
"""
