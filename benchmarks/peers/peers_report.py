"""The table and the busbw plot of an allreduce_peers.py run, rendered from its results.json.

    python benchmarks/peers/peers_report.py DIR/results.json     # rewrites DIR/results.md, busbw.png

The memory bound drawn on the plot: an in-place all-reduce over n ranks through shared memory must
read every rank's input once (n S bytes for S bytes a rank) and write the sum into every rank's
buffer (n S), so it moves at least 2 n S bytes through memory: t >= 2 n S / B, where B is the
host's STREAM bandwidth with as many threads as ranks (the best of copy and add, bytes counted as
STREAM counts them). With busbw = (S / t) 2(n-1)/n this is busbw <= B (n-1) / n^2, B / 4 at n = 2.
It holds once the buffers no longer fit in the last-level cache.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def memory_bound_GBps(doc: dict, world: int) -> float | None:
    stream = doc.get("stream")
    if not stream:
        return None
    cores = doc["host"]["cores"]
    row = stream.get(str(min(world, cores))) or stream[max(stream, key=int)]
    bandwidth = max(row["copy_GBps"], row["add_GBps"])
    return bandwidth * (world - 1) / world**2


def _size_text(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def _time_text(us: float) -> str:
    return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.1f} us"


def _table(doc: dict, world: int) -> list[str]:
    points = [p for p in doc["points"] if p["world_size"] == world]
    peers = list(dict.fromkeys(p["peer"] for p in points))
    by = {(p["peer"], p["bytes"]): p for p in points}
    sizes = sorted({p["bytes"] for p in points})
    others = [p for p in peers if not p.startswith("dpscale")]
    head = ["size"] + [f"{p} time (p10-p90) / busbw" for p in peers]
    if "dpscale" in peers and others:
        head.append("dpscale / best peer busbw")
    bound = memory_bound_GBps(doc, world)
    if "dpscale" in peers and bound:
        head.append("dpscale / memory bound")
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for s in sizes:
        row = [_size_text(s)]
        for peer in peers:
            p = by.get((peer, s))
            row.append(
                "-"
                if p is None
                else f"{_time_text(p['time_us'])} ({_time_text(p['time_us_p10'])}-"
                f"{_time_text(p['time_us_p90'])}) / {p['busbw_GBps']:.3g} GB/s"
            )
        if "dpscale" in peers and others:
            best = max(
                (by[(o, s)] for o in others if (o, s) in by), key=lambda p: p["busbw_GBps"], default=None
            )
            mine = by.get(("dpscale", s))
            row.append(
                "-"
                if best is None or mine is None
                else f"{mine['busbw_GBps'] / best['busbw_GBps']:.2f}x ({best['peer']})"
            )
        if "dpscale" in peers and bound:
            mine = by.get(("dpscale", s))
            # the bound is about memory: below 1 MiB the buffers live in cache
            row.append("-" if mine is None or s < 1 << 20 else f"{mine['busbw_GBps'] / bound:.0%}")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def markdown(doc: dict) -> str:
    host = doc["host"]
    out = [
        f"# CPU all-reduce peers, {doc['date_utc']} UTC",
        "",
        f"{host['cpu']}, {host['cores']} cores; load {host['load_before']:.1f} before, "
        f"{host.get('load_after', float('nan')):.1f} after; {doc['config']['rounds']} alternating rounds, "
        f"{doc['config']['busy']} busy processes; {doc.get('wall_s', 0):.0f} s. float32, in place; a call's "
        "time is the slowest rank's; median (p10-p90) over every round's calls; busbw = algbw x 2(n-1)/n.",
    ]
    if doc.get("stream"):
        rows = ", ".join(
            f"{t} thread(s) copy {r['copy_GBps']:.1f} / add {r['add_GBps']:.1f} GB/s"
            for t, r in doc["stream"].items()
        )
        out += ["", f"Memory bandwidth (stream.c, {doc['config']['stream_mib']} MiB arrays): {rows}."]
    for world_text, peers in doc["peers"].items():
        world = int(world_text)
        meta = doc.get("worlds", {}).get(world_text, {})
        flag = " (**oversubscribed**: more ranks than cores)" if meta.get("oversubscribed") else ""
        out += ["", f"## World size {world}{flag}, {meta.get('threads_per_rank', '?')} thread(s) a rank", ""]
        bound = memory_bound_GBps(doc, world)
        if bound is not None:
            out += [f"Memory bound on busbw (see peers_report.py): {bound:.2f} GB/s.", ""]
        out += _table(doc, world)
        out.append("")
        for peer, m in peers.items():
            if "skipped" in m:
                out.append(f"- {peer}: **not measured**: {m['skipped']}")
            else:
                errs = f"; **wrong sums**: {m['errors'][:3]}" if m.get("errors") else ""
                out.append(f"- {peer}: {json.dumps(m['info'])}{errs}")
    return "\n".join(out) + "\n"


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    worlds = sorted({p["world_size"] for p in doc["points"]})
    if not worlds:
        return
    fig, axes = plt.subplots(1, len(worlds), figsize=(7 * len(worlds), 5), squeeze=False)
    for ax, world in zip(axes[0], worlds, strict=True):
        points = [p for p in doc["points"] if p["world_size"] == world]
        for peer in dict.fromkeys(p["peer"] for p in points):
            mine = sorted((p for p in points if p["peer"] == peer), key=lambda p: p["bytes"])
            xs = [p["bytes"] for p in mine]
            ys = [p["busbw_GBps"] for p in mine]
            style = {"linewidth": 2.5} if peer == "dpscale" else {"linewidth": 1.2}
            ax.plot(xs, ys, marker="o", markersize=3, label=peer, **style)
        bound = memory_bound_GBps(doc, world)
        if bound is not None:
            label = f"memory bound {bound:.1f} GB/s (once buffers exceed the LLC)"
            ax.axhline(bound, color="black", linestyle="--", label=label)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator([4 * 16**k for k in range(8)]))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: _size_text(int(x))))
        ax.set_yscale("log")
        ax.set_xlabel("bytes per rank (float32, in place)")
        ax.set_ylabel("busbw, GB/s")
        over = " (oversubscribed)" if doc.get("worlds", {}).get(str(world), {}).get("oversubscribed") else ""
        ax.set_title(f"all-reduce busbw, {world} ranks{over}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{doc['host']['cpu']}, {doc['host']['cores']} cores, {doc['date_utc']} UTC", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(doc: dict, out: Path) -> str:
    text = markdown(doc)
    (out / "results.md").write_text(text)
    plot(doc, out / "busbw.png")
    return text


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    path = Path(sys.argv[1])
    render(json.loads(path.read_text()), path.parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
