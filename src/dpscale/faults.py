"""Test-only fault injection, off unless the environment variable DPSCALE_FAULTS is set.

DPSCALE_FAULTS holds `;`-separated faults, each `name@key=value,key=value`, for example
`nan_grad@step=5,rank=1`. Code asks at a named point: `injected("nan_grad", step=5, rank=1)` is
true when a listed fault of that name matches every key it names. Normal runs never set the
variable, so the check is a dictionary lookup on an empty table.

Named points: `nan_grad` (trainer, after backward, before the skip decision; keys step, rank).
"""

from __future__ import annotations

import os

ENV = "DPSCALE_FAULTS"


def _parse(text: str) -> list[tuple[str, dict[str, str]]]:
    faults = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        name, _, args = item.partition("@")
        keys = dict(kv.split("=", 1) for kv in args.split(",") if kv)
        faults.append((name.strip(), {k.strip(): v.strip() for k, v in keys.items()}))
    return faults


def injected(name: str, **where: object) -> bool:
    text = os.environ.get(ENV)
    if not text:
        return False
    for fault, keys in _parse(text):
        if fault == name and all(str(where.get(k)) == v for k, v in keys.items()):
            return True
    return False
