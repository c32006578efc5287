"""What `pip install dpscale` brings and what it leaves to the lab extra; the system facts reports name."""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from dpscale.errors import import_extra
from dpscale.lab.bench import report, sysinfo
from dpscale.workloads import datasets

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_engine_needs_torch_and_numpy_only_and_the_lab_extra_brings_the_rest():
    assert sorted(Requirement(r).name for r in PROJECT["dependencies"]) == ["numpy", "torch"]
    lab = {Requirement(r).name for r in PROJECT["optional-dependencies"]["lab"]}
    assert lab == {"matplotlib", "scikit-learn", "rich"}
    assert "lab" in (ROOT / "Makefile").read_text().split("pip install -q -e")[1].splitlines()[0]


def test_the_package_says_it_is_typed():
    assert (ROOT / "src" / "dpscale" / "py.typed").is_file()
    assert (
        "py.typed"
        in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
            "dpscale"
        ]
    )


def test_a_missing_lab_package_is_one_line_naming_the_extra(monkeypatch):
    # None in sys.modules makes the import fail, as when the package is not installed
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(
        ValueError, match=r"needs matplotlib, part of dpscale's lab extra: pip install 'dpscale\[lab\]'"
    ):
        report.new_figure()
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(ValueError, match=r"^the digits workload needs scikit-learn, .*'dpscale\[lab\]'$"):
        datasets.digits()
    assert import_extra("json", "anything").dumps(1) == "1"


@pytest.mark.slow
def test_without_the_lab_extra_the_cli_starts_and_lab_commands_refuse_before_measuring(tmp_path):
    script = (
        "import sys\n"
        "sys.modules.update(matplotlib=None, sklearn=None, rich=None)\n"  # as if not installed
        "from dpscale.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    for argv in (
        ["bench", "allreduce", "--report-dir", str(tmp_path)],
        ["study", "--quick", "--report-dir", str(tmp_path)],
        ["train", "--max-steps", "1"],
    ):
        p = subprocess.run(
            [sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT
        )
        assert p.returncode == 2, (argv, p.stderr)
        (line,) = p.stderr.strip().splitlines()
        assert line.endswith("part of dpscale's lab extra: pip install 'dpscale[lab]'"), line
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_reports_name_the_accelerator_libraries_of_the_torch_build():
    libraries = sysinfo._accelerator_libraries()
    assert set(libraries) == {"cuda", "cudnn", "nccl"}
    info = {
        "hostname": "h",
        "timestamp_utc": "2026-12-01T00:00:00Z",
        "hardware": {"cpu_model": "x", "logical_cores": 2, "usable_cores": 2, "memory_GiB": 1.0, "gpus": []},
        "software": {"python": "3.11", "torch": "2.13.0", "numpy": "2", "dpscale": "0.1", "platform": "p"},
    }
    old = sysinfo.describe_system(info)  # a report written before the libraries were kept
    assert "CUDA" not in old[1]
    info["software"] |= {"cuda": "12.6", "cudnn": "90100", "nccl": "2.21.5"}
    assert "torch 2.13.0 (CUDA 12.6, cuDNN 90100, NCCL 2.21.5)," in sysinfo.describe_system(info)[1]
    info["software"] |= {"cuda": None, "cudnn": None, "nccl": None}
    assert "torch 2.13.0 (CPU build: no CUDA)," in sysinfo.describe_system(info)[1]
