"""Parse the list- and size-valued flags that every bench shares (`--sizes 4K,16M`, `--nproc 1,2`).

Flags arrive as plain strings and are parsed here rather than through argparse's `type=`, so a bad
value raises a one-line ValueError naming the flag; the CLI turns that into exit code 2. Sizes are
binary (4K = 4096 bytes), as in nccl-tests, because message sizes are swept in powers of two.
"""

from __future__ import annotations

import re
from dataclasses import field
from typing import Any

from dpscale.errors import ConfigError
from dpscale.flags import flag_spec

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
# "16M", "16MiB", "16MB", "4096", "4096B": one integer, an optional binary unit, an optional "B".
# "MB" is read as binary too: in a size sweep nobody means 10**6, and refusing it would only annoy.
_SIZE_RE = re.compile(r"^\s*(\d+)\s*(?:([KMG])(?:I?B)?|B)?\s*$", re.IGNORECASE)


def parse_size(text: str, *, flag: str = "size") -> int:
    """Read "16M" as 16 * 2**20 bytes; `flag` names the option in the error message."""
    m = _SIZE_RE.match(text)
    if m is None:
        raise ConfigError(
            f"{flag}: cannot read {text!r} as a size; use an integer with an optional K, M or G "
            f"suffix (binary: 4K = 4096 bytes), e.g. 4K,16M"
        )
    value = int(m.group(1)) * _UNITS[(m.group(2) or "").upper()]
    if value < 1:
        raise ConfigError(f"{flag}: size {text!r} is zero; sizes must be at least 1 byte")
    return value


def format_size(num_bytes: int) -> str:
    """The inverse of parse_size for display: 4 -> "4B", 1024 -> "1K", 64 * 2**20 -> "64M"."""
    for suffix, unit in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if num_bytes >= unit:
            value = num_bytes / unit
            return f"{value:.0f}{suffix}" if value == int(value) else f"{value:.3g}{suffix}"
    return f"{num_bytes}B"


def _items(text: str, flag: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise ConfigError(f"{flag}: {text!r} has an empty entry; give a comma-separated list like 1,2,4")
    return items


def parse_size_list(text: str, *, flag: str = "--sizes") -> list[int]:
    """Read "4,4K,16M" as [4, 4096, 16777216] (kept in the given order)."""
    return [parse_size(item, flag=flag) for item in _items(text, flag)]


def parse_int_list(text: str, *, flag: str, minimum: int | None = None) -> list[int]:
    """Read "1,2,4" as [1, 2, 4]; values below `minimum` are refused with the flag named."""
    values = []
    for item in _items(text, flag):
        try:
            value = int(item)
        except ValueError:
            raise ConfigError(f"{flag}: {item!r} is not an integer; give a list like 1,2,4") from None
        if minimum is not None and value < minimum:
            raise ConfigError(f"{flag}: {value} is too small; every value must be >= {minimum}")
        values.append(value)
    return values


def parse_name_list(text: str, *, flag: str, choices: list[str] | None = None) -> list[str]:
    """Read "gloo,shm" as ["gloo", "shm"]; with `choices`, unknown names are refused."""
    names = _items(text, flag)
    if choices is not None:
        unknown = [n for n in names if n not in choices]
        if unknown:
            raise ConfigError(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(choices)}")
    return names


def nproc_list_field() -> Any:
    """The benches' `--nproc 1,2` (world sizes, one run each; `--world-sizes` still works, with a
    deprecation line), a dataclass field defaulting to [1, 2]."""
    return field(
        default_factory=lambda: [1, 2],
        metadata=flag_spec(
            name="--nproc",
            deprecated=("--world-sizes",),
            parse=lambda s: parse_int_list(s, flag="--nproc", minimum=1),
        ),
    )
