"""`dpscale scale` across two emulated hosts: torchrun's multi-node flags, one job per world size."""

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

NANOGPT = str(Path(__file__).resolve().parents[2] / "examples" / "nanogpt_style.py")


def _all_rows(procs, timeout_s: float) -> list[list[dict]]:
    """Every host's JSON rows; on a hang, every host is killed and every host's stderr shown."""
    outs, deadline = [], time.monotonic() + timeout_s  # one deadline for all: under pytest-timeout
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        tails = [f"host {i}:\n{proc.communicate()[1][-3000:]}" for i, proc in enumerate(procs)]
        pytest.fail(f"dpscale scale hung past {timeout_s} s\n" + "\n".join(tails))
    for proc, (_, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, err[-3000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


@pytest.mark.parametrize("rendezvous", ["dynamic", "static"])
def test_scale_measures_a_world_size_that_spans_two_hosts(hosts, tmp_path, rendezvous):
    scale = [
        sys.executable,
        "-m",
        "dpscale.cli.main",
        "scale",
        "--nproc",
        "1,2",
        "--steps",
        "4",
        "--warmup",
        "1",
    ]
    scale += ["--threads-per-worker", "1", "--nnodes", "2", "--rdzv-endpoint", f"{hosts.addrs[0]}:29400"]
    scale += ["--rdzv-id", f"test-{uuid.uuid4().hex[:8]}", "--json"]
    procs = []
    for i, addr in enumerate(hosts.addrs):
        (tmp_path / f"h{i}").mkdir()
        rank = ["--node-rank", str(i)] if rendezvous == "static" else []
        argv = [*scale, "--local-addr", addr, *rank, "--report-dir", "reports", "--", NANOGPT]
        procs.append(hosts.start(i, [*argv, "--eval_interval=1000"], cwd=tmp_path / f"h{i}"))
    first, second = _all_rows(procs, 240)
    # host 0 serves the store, so it alone runs the 1-worker baseline and knows the efficiency
    assert [(r["world_size"], r["hosts"]) for r in first] == [(1, 1), (2, 2)]
    assert first[0]["efficiency"] == 1.0 and first[1]["efficiency"] > 0
    # the other host measured the same N = 2 job: every rank's telemetry reached it too
    assert [(r["world_size"], r["hosts"], r["efficiency"]) for r in second] == [(2, 2, None)]
    assert second[0]["steps"] == first[1]["steps"] == 4
    (report,) = (tmp_path / "h0" / "reports").iterdir()
    assert "Across 2 hosts" in (report / "report.md").read_text()


def test_bench_scaling_measures_a_world_size_that_spans_two_hosts(hosts, tmp_path):
    bench = [
        sys.executable,
        "-m",
        "dpscale.cli.main",
        "bench",
        "scaling",
        "--world-sizes",
        "1,2",
        "--steps",
        "5",
    ]
    bench += ["--warmup", "1", "--engines", "dpscale,torch", "--nnodes", "2", "--json"]
    bench += ["--rdzv-endpoint", f"{hosts.addrs[0]}:29400", "--rdzv-id", f"test-{uuid.uuid4().hex[:8]}"]
    procs = []
    for i, addr in enumerate(hosts.addrs):
        (tmp_path / f"h{i}").mkdir()
        argv = [*bench, "--local-addr", addr, "--report-dir", "reports"]
        procs.append(hosts.start(i, argv, cwd=tmp_path / f"h{i}"))
    first, second = _all_rows(procs, 240)
    rows = {(r["engine"], r["world_size"]): r for r in first}
    assert {k: r["hosts"] for k, r in rows.items()} == {
        ("dpscale", 1): 1,
        ("torch", 1): 1,
        ("dpscale", 2): 2,
        ("torch", 2): 2,
    }
    assert all(rows[(e, 2)]["efficiency"] > 0 for e in ("dpscale", "torch"))
    # the other host: the same job's rows, with every rank's times, but no baseline of its own
    assert sorted((r["engine"], r["world_size"], r["hosts"], r["efficiency"]) for r in second) == [
        ("dpscale", 2, 2, None),
        ("torch", 2, 2, None),
    ]
    (report,) = (tmp_path / "h0" / "reports").iterdir()
    assert "Across 2 hosts" in (report / "report.md").read_text()
