"""What `pip install dpscale` brings and what it leaves to the lab extra; the system facts reports name.
Checked on what is installed and on a wheel built from this tree, not on pyproject.toml's text."""

import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from dpscale.errors import import_extra
from dpscale.lab.bench import report, sysinfo
from dpscale.workloads import datasets

ROOT = Path(__file__).resolve().parents[1]
LAB = {"matplotlib", "scikit-learn", "rich"}


def _requirements(requires: list[str]) -> tuple[set[str], set[str]]:
    """(the names every install brings, the names the lab extra adds) from Requires-Dist lines."""
    reqs = [Requirement(r) for r in requires]
    base = {r.name for r in reqs if r.marker is None}
    lab = {r.name for r in reqs if r.marker is not None and r.marker.evaluate({"extra": "lab"})} - base
    return base, lab


def test_the_engine_needs_torch_and_numpy_only_and_the_lab_extra_brings_the_rest():
    base, lab = _requirements(importlib.metadata.requires("dpscale"))
    assert base == {"numpy", "torch"} and lab == LAB
    # `make` installs the lab extra, so the lab's tests run on what they import
    for module in ("matplotlib", "sklearn", "rich"):
        assert importlib.util.find_spec(module) is not None, module


def test_the_dpscale_command_and_the_torchrun_handler_resolve_to_the_entry_points():
    (script,) = importlib.metadata.entry_points(group="console_scripts", name="dpscale")
    from _dpscale_cli import run

    assert script.load() is run
    (handler,) = importlib.metadata.entry_points(group="torchrun.handlers", name="dpscale-c10d")
    from dpscale.launch.torchrun_plugin import torchrun_handler

    assert handler.load() is torchrun_handler


@pytest.mark.slow
def test_the_wheel_is_typed_and_carries_the_command_and_only_torch_and_numpy(tmp_path):
    # built from a copy, so the build's egg-info and build/ never land in the tree under test
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            ".",
        ],
        cwd=tree,
        check=True,
        capture_output=True,
        timeout=240,
    )
    (wheel,) = tmp_path.glob("dpscale-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (info,) = {n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA")}
        metadata = Parser().parsestr(z.read(f"{info}/METADATA").decode())
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    assert "dpscale/py.typed" in names
    assert "dpscale/comm/shm_small.c" in names  # the shm transport's C helper, built at first use
    assert _requirements(metadata.get_all("Requires-Dist")) == ({"numpy", "torch"}, LAB)
    assert "dpscale = _dpscale_cli:run" in entry_points
    assert "_dpscale_cli.py" in names  # the entry point, beside the package
    assert "dpscale-c10d = dpscale.launch.torchrun_plugin:torchrun_handler" in entry_points


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
