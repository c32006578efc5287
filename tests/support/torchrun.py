"""torchrun's command line, as the tests that run dpscale under plain torchrun start it."""

from __future__ import annotations

import sys
from pathlib import Path


def torchrun(log_dir: Path, *flags: str) -> list[str]:
    """`python -m torch.distributed.run` with `flags`, its log folder in `log_dir`: by default
    torchrun makes one in /tmp (torchelastic_*) and never removes it."""
    return [sys.executable, "-m", "torch.distributed.run", "--log-dir", str(log_dir), *flags]
