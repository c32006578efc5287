"""Trust checks: when a timing report's figures describe the host more than the engines.

On a shared or busy machine the benches still produce numbers; these checks say when not to
believe them, one warning line per kind, in the terminal and at the head of the report:

- the unsynchronized `local` engine below 90% scaling efficiency: workers that never talk to
  each other should scale almost linearly, so the host is busy or the workers contend for cores,
  memory bandwidth or caches, and every engine's efficiency is understated by as much;
- a negative overhead: an engine stepping faster than `local`, which does strictly less work,
  means the differences are within the noise;
- a p10-p90 spread of the step time above 20% of its median: the load moved during the run.

A row is a mapping with engine, world_size, efficiency, overhead_ms and spread (ScalingPoint's
fields and `spread`, or the study summary's row), or with a label and a spread (an all-reduce
point); a missing or None figure is not checked.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

LOCAL_EFFICIENCY_MIN = 0.9
SPREAD_MAX = 0.2


def _where(row: Mapping) -> str:
    if row.get("label"):  # a row that names itself (an all-reduce point)
        return str(row["label"])
    model = f"{row['model']} " if row.get("model") else ""
    return f"{model}{row['engine']} N={row['world_size']}"


def timing_warnings(rows: Iterable[Mapping], *, more: str = "--steps") -> list[str]:
    """One line per check that fails on any row, naming the rows and what to do; `more` is the
    flag that times more of them (--steps, --iters)."""
    rows = list(rows)
    slow_local = [
        f"{_where(r)} {r['efficiency']:.0%}"
        for r in rows
        if r.get("engine") == "local"
        and r.get("world_size", 1) > 1
        and r.get("efficiency") is not None
        and r["efficiency"] < LOCAL_EFFICIENCY_MIN
    ]
    negative = [
        f"{_where(r)} {r['overhead_ms']:.2f} ms"
        for r in rows
        if r.get("engine") != "local" and r.get("overhead_ms") is not None and r["overhead_ms"] < 0
    ]
    spread = [
        f"{_where(r)} {r['spread']:.0%}"
        for r in rows
        if r.get("spread") is not None and r["spread"] > SPREAD_MAX
    ]
    out = []
    if slow_local:
        out.append(
            f"the unsynchronized local engine scales below {LOCAL_EFFICIENCY_MIN:.0%} "
            f"({', '.join(slow_local)}): the host is busy or the workers contend for cores or memory, "
            "so every efficiency here is understated; rerun on a quiet host"
        )
    if negative:
        out.append(
            f"negative overhead ({', '.join(negative)}): faster than local, which does no "
            "synchronization at all, so differences this small are noise"
        )
    if spread:
        out.append(
            f"times spread (p10-p90) above {SPREAD_MAX:.0%} of the median ({', '.join(spread)}): "
            f"the load changed during the run; rerun on a quieter host or with more {more}"
        )
    return out
