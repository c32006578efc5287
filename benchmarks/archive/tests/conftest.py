"""The archived scripts' tests, outside the default suite (pytest's testpaths is tests/):

    python -m pytest -q benchmarks/archive/tests

Each script is imported as `python benchmarks/archive/<script>.py` runs it: with its own folder on
sys.path (its siblings), and benchmarks/ for what it uses that stayed there (auto_batch.py, predict_lab/).
"""

import sys
from pathlib import Path

ARCHIVE = Path(__file__).resolve().parents[1]
for folder in (ARCHIVE.parent, ARCHIVE, Path(__file__).resolve().parent):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
