"""The torch range: pyproject's floor, the tested releases as data, and the import-time check."""

import re
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from dpscale import torch_range
from dpscale.torch_range import UntestedTorchWarning, check_torch_version, release

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _torch_requirement() -> Requirement:
    (req,) = [Requirement(r) for r in PROJECT["dependencies"] if Requirement(r).name == "torch"]
    return req


def test_pyproject_admits_every_tested_release_and_newer_ones_and_nothing_below_the_floor():
    spec = _torch_requirement().specifier
    for version in [*torch_range.TESTED_RELEASES, "2.14.1+cu128", "2.16.0", "3.0.0"]:
        assert spec.contains(version), version
    assert not spec.contains("2.10.0")
    # the floor is the module's: one number, said in two places that must agree
    assert spec.contains(".".join(map(str, torch_range.OLDEST_SUPPORTED)) + ".0")


def test_the_tested_releases_span_the_range_the_check_uses():
    lines = sorted(release(v) for v in torch_range.TESTED_RELEASES)
    assert lines[0] == torch_range.OLDEST_SUPPORTED
    assert lines[-1] == torch_range.NEWEST_TESTED


@pytest.mark.parametrize(
    "version, expected",
    [("2.14.1+cu128", (2, 14)), ("2.11.0", (2, 11)), ("2.16.0.dev20270101", (2, 16)), ("3.0", (3, 0))],
)
def test_release_reads_major_and_minor(version, expected):
    assert release(version) == expected


def test_an_unreadable_version_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="'nightly'"):
        release("nightly")


@pytest.mark.parametrize("version", ["2.11.0", "2.13.0+cpu", "2.14.1+cu128", "2.15.0", "2.15.3"])
def test_a_tested_release_imports_silently(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_torch_version(version)


@pytest.mark.parametrize("version", ["2.16.0", "2.16.0.dev20270101+cu130", "3.0.0"])
def test_a_newer_torch_gets_one_warning_and_is_never_refused(version):
    with pytest.warns(UntestedTorchWarning) as caught:
        check_torch_version(version)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "\n" not in message
    assert message.startswith(
        f"torch {version} is newer than the releases dpscale was tested on (up to 2.15.x)"
    )


@pytest.mark.parametrize("version", ["2.10.2", "2.8.0+cu126", "1.13.1"])
def test_an_older_torch_is_refused_with_the_release_to_install(version):
    with pytest.raises(
        ImportError, match="^" + re.escape(f"dpscale needs torch>=2.11, and torch {version} is installed: ")
    ):
        check_torch_version(version)


def _import_dpscale_with_torch_version(version: str) -> subprocess.CompletedProcess:
    # a faked torch.__version__ before dpscale's first import: the check in dpscale/__init__.py runs
    script = f"import torch; torch.__version__ = {version!r}; import dpscale; print('imported')"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_importing_dpscale_under_a_newer_torch_prints_one_warning_line():
    done = _import_dpscale_with_torch_version("2.99.0")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "imported\n"
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "UntestedTorchWarning: torch 2.99.0 is newer than the releases dpscale was tested on" in lines[0]


@pytest.mark.slow
def test_importing_dpscale_under_an_older_torch_fails_with_one_line_naming_the_fix():
    done = _import_dpscale_with_torch_version("2.10.0")
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        "ImportError: dpscale needs torch>=2.11, and torch 2.10.0 is installed: pip install 'torch>=2.11'"
    )


@pytest.mark.slow
@pytest.mark.compat
def test_the_installed_torch_is_in_the_tested_range_and_imports_silently():
    import torch

    assert torch_range.OLDEST_SUPPORTED <= release(torch.__version__) <= torch_range.NEWEST_TESTED
    done = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", "import dpscale"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
