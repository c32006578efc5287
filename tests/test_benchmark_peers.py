"""benchmarks/peers: the memory bound's arithmetic, the sizes and the refusals of bad flags (the
driver itself starts every peer's ranks and runs on a quiet host only)."""

import pytest

from support.benchmark_module import BENCHMARKS, load_benchmark


@pytest.fixture
def report(monkeypatch):
    return load_benchmark(BENCHMARKS / "peers" / "peers_report.py", "_bench_peers_report", monkeypatch)


@pytest.fixture
def driver(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS / "peers"))
    return load_benchmark(BENCHMARKS / "peers" / "allreduce_peers.py", "_bench_allreduce_peers", monkeypatch)


def test_the_bound_is_b_over_4_at_two_ranks_and_3b_over_16_at_four(report):
    doc = {
        "host": {"cores": 2},
        "stream": {"1": {"copy_GBps": 10.0, "add_GBps": 9.0}, "2": {"copy_GBps": 16.0, "add_GBps": 20.0}},
    }
    assert report.memory_bound_GBps(doc, 2) == pytest.approx(20.0 / 4)
    # four ranks on two cores share the two cores' bandwidth
    assert report.memory_bound_GBps(doc, 4) == pytest.approx(20.0 * 3 / 16)
    assert report.memory_bound_GBps({"host": {"cores": 2}, "stream": None}, 2) is None


def test_sizes_are_whole_floats_sorted_and_binary(driver):
    assert driver._sizes("1M,4K,4") == [4, 4096, 1 << 20]
    assert driver._sizes("6") == [4]  # rounded down to whole float32s
    assert driver.DEFAULT_SIZES[0] == 4 and driver.DEFAULT_SIZES[-1] == 256 << 20


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--world-sizes", "1"], "--world-sizes"),
        (["--peers", "dpscale,nccl"], "--peers: unknown nccl"),
        (["--rounds", "0"], "--rounds"),
    ],
)
def test_bad_flags_are_refused_in_one_line(driver, flags, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        driver._parse(["--out", str(tmp_path)] + flags)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_iterations_scale_with_size_within_the_limits(driver, tmp_path):
    args = driver._parse(["--out", str(tmp_path)])
    assert driver._iters(4, args) == 100
    assert driver._iters(1 << 20, args) == 64
    assert driver._iters(256 << 20, args) == 5
