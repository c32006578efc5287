"""nccl-tests `all_reduce_perf` output: the shipped tables parse, bad files are one line naming file and line.

The tables under data/nccl_tests are transcribed from public sources (data/nccl_tests/README.md).
"""

from pathlib import Path

import pytest

from dpscale.lab.predict import nccl_tests
from dpscale.lab.predict.nccl_tests import read_table

DATA = Path(__file__).resolve().parent / "data" / "nccl_tests"
H100_16 = DATA / "h100-16gpu-2node.txt"
ROW = "  1048576  262144  float  sum  -1    203.2    5.16    9.68      0    207.2    5.06    9.49      0"
HEADER = "# nThread 1 nGpus 4 minBytes 8 maxBytes 8 step: 2(factor)"


def test_the_16_gpu_h100_table_parses_with_its_ranks_hosts_and_rows():
    t = read_table(H100_16)
    assert (t.world_size, t.nodes, t.per_node) == (16, 2, 8)
    assert len(t.sizes_bytes) == 31 and t.sizes_bytes[0] == 8 and t.sizes_bytes[-1] == 8589934592
    assert t.time_us[-1] == 47535 and t.in_place_time_us[-1] == 47743 and t.busbw_GBps[-1] == 338.82
    # nccl-tests' busbw is algbw x 2(n-1)/n: the printed figure follows from the printed time
    assert nccl_tests.busbw_GBps(t.sizes_bytes[-1], t.time_us[-1], 16) == pytest.approx(338.82, rel=1e-3)


def test_the_other_shipped_tables_parse():
    gb10 = read_table(DATA / "gb10-2gpu-2node-partial.txt")
    assert (gb10.world_size, gb10.nodes, len(gb10.sizes_bytes)) == (2, 2, 4)
    pcie = read_table(DATA / "h100-pcie-2gpu-large.txt")  # no rank lines: nThread x nGpus
    assert (pcie.world_size, pcie.nodes, pcie.time_us) == (2, 1, (9306.7, 18535.0))
    # two clusters of the same hardware (nccl-tests issue #309); the version line between the rank
    # lines and the table is skipped
    xe = read_table(DATA / "h100-ndr-16gpu-2node-xe9680.txt")
    assert (xe.world_size, xe.nodes, len(xe.sizes_bytes), xe.time_us[-1]) == (16, 2, 32, 68652.0)
    other = read_table(DATA / "h100-ndr-16gpu-2node-other-cluster.txt")
    assert (other.world_size, other.nodes, len(other.sizes_bytes)) == (16, 2, 14)
    assert other.sizes_bytes[0] == 1 << 20
    for t in (xe, other):
        for size, us, printed in zip(t.sizes_bytes, t.time_us, t.busbw_GBps, strict=True):
            assert nccl_tests.busbw_GBps(size, us, 16) == pytest.approx(printed, abs=0.02, rel=3e-3), size


def test_the_12_column_variant_without_root_and_an_error_column_parses(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(
        f"{HEADER}\n  1024  256  float  sum  47.44  0.02  0.02  6e-08  53.56  0.02  0.02  6e-08\n"
    )
    assert read_table(path).time_us == (47.44,)


@pytest.mark.parametrize(
    "body, says",
    [
        (
            f"{HEADER}\n{ROW}\n  2048  512  float  sum  -1  12.0  0.1  0.1\n",
            "line 3: a table row has 12 or 13",
        ),
        (f"{HEADER}\n{ROW.replace('203.2', 'fast')}\n", "line 2: out-of-place time 'fast' is not a number"),
        (f"{HEADER}\n{ROW.replace('203.2', 'nan')}\n", "line 2: out-of-place time 'nan' is not a finite"),
        (f"{HEADER}\n{ROW}\n{ROW}\n", "line 3: size 1048576 after 1048576"),
        (f"{HEADER}\n# Avg bus bandwidth : 1\n", "has no all_reduce_perf table rows"),
        (f"{ROW}\n", "neither '# Rank N"),
        (f"# nThread 1 nGpus 1\n{ROW}\n", "ran on 1 GPU"),
    ],
)
def test_a_malformed_file_is_one_line_naming_the_file_and_line(tmp_path, body, says):
    path = tmp_path / "bad.txt"
    path.write_text(body)
    with pytest.raises(ValueError, match="--calibrate-from") as e:
        read_table(path)
    assert str(path) in str(e.value) and says in str(e.value) and "\n" not in str(e.value)


def test_a_file_that_is_not_text_or_too_large_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    binary = tmp_path / "b.txt"
    binary.write_bytes(f"{HEADER}\n".encode() + b"\xff\xfe\n")
    with pytest.raises(ValueError, match="line 2: not UTF-8"):
        read_table(binary)
    monkeypatch.setattr(nccl_tests, "MAX_FILE_BYTES", 100)
    with pytest.raises(ValueError, match=r"is [0-9,]+ bytes"):
        read_table(H100_16)
    with pytest.raises(ValueError, match="cannot read"):
        read_table(tmp_path / "absent.txt")
