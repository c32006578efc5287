"""An engine-side fix that `dpscale scale --try` applies to the script's DDP model, unchanged script.

`fp16` (gradients averaged in float16: half the bytes on the wire), `bucket_cap_mb=X` (every bucket
capped at X MiB, overriding the script's value) and `accumulation=K` (one all-reduce per K synced
steps). The fix travels to the workers in TRY_ENV; run_child.py applies it to dpscale's engine
when the script builds its DDP model.

`accumulation=K` is a timing trial, not training: the stand-in runs K - 1 of every K synchronized
steps as if under no_sync(), while the script's optimizer still steps on each (its update on the
local gradients), so the measured step holds K - 1 optimizer steps that real accumulation would not.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpscale.errors import ConfigError

TRY_ENV = "DPSCALE_RUN_TRY"  # one fix, as its flag spells it
KINDS = ("fp16", "bucket_cap_mb", "accumulation")
MAX_ACCUMULATION = 64


@dataclass(frozen=True)
class EngineTry:
    kind: str  # one of KINDS
    value: float | None = None  # MiB for bucket_cap_mb, K for accumulation

    @property
    def flag(self) -> str:
        """As --try spells it (and TRY_ENV carries it)."""
        return self.kind if self.value is None else f"{self.kind}={self.value:g}"

    @property
    def label(self) -> str:
        """In words, for the report."""
        if self.kind == "fp16":
            return "fp16 compression"
        return f"{self.kind} {self.value:g}"


def parse_try(text: str, *, flag: str = "--try") -> EngineTry:
    name, eq, raw = (part.strip() for part in text.partition("="))
    if name not in KINDS:
        raise ConfigError(
            f"{flag}: unknown fix {text!r}; give fp16, bucket_cap_mb=MiB or accumulation=K, comma-separated"
        )
    if name == "fp16":
        if eq:
            raise ConfigError(f"{flag}: fp16 takes no value, got {text!r}")
        return EngineTry("fp16")
    try:
        value = float(raw) if name == "bucket_cap_mb" else int(raw)
    except ValueError:
        value = -1.0
    if name == "bucket_cap_mb" and not 0 < value <= 1024:
        raise ConfigError(f"{flag}: bucket_cap_mb must be a size in MiB in (0, 1024], got {text!r}")
    if name == "accumulation" and not 2 <= value <= MAX_ACCUMULATION:
        raise ConfigError(
            f"{flag}: accumulation must be an integer from 2 to {MAX_ACCUMULATION}, got {text!r}"
        )
    return EngineTry(name, value)


def parse_try_list(text: str, *, flag: str = "--try") -> list[str]:
    """The fixes of a comma-separated --try, each checked, as their flags (the config keeps strings)."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise ConfigError(
            f"{flag}: {text!r} has an empty entry; e.g. --try fp16,bucket_cap_mb=50,accumulation=2"
        )
    fixes = [parse_try(item, flag=flag).flag for item in items]
    if len(set(fixes)) != len(fixes):
        raise ConfigError(f"{flag}: {text!r} names a fix twice")
    return fixes
