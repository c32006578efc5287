"""Launcher inputs: the world size range, which sizes can start, and the rendezvous address check."""

from dataclasses import replace

import pytest

from dpscale.launch.launcher import _can_start, _splits, launch, parse_nproc
from dpscale.launch.nodes import rendezvous_warning
from dpscale.train.config import TrainConfig


@pytest.mark.parametrize("text,expected", [("1", (1, 1)), ("4", (4, 4)), ("2:4", (2, 4)), ("3:3", (3, 3))])
def test_nproc_is_n_or_a_range(text, expected):
    assert parse_nproc(text) == expected


@pytest.mark.parametrize("text", ["0", "-1", "3:2", "0:2", "two", "1:", ":2", "1:2:3"])
def test_bad_nproc_says_what_is_accepted(text):
    with pytest.raises(ValueError, match="N or MIN:MAX"):
        parse_nproc(text)


@pytest.mark.parametrize("addr", ["127.0.0.1", "::1", "localhost", None, ""])
def test_loopback_rendezvous_needs_no_warning(addr):
    assert rendezvous_warning(addr) is None


@pytest.mark.parametrize("addr", ["10.0.0.7", "192.168.1.20", "no-such-host.invalid"])
def test_other_rendezvous_addresses_get_a_warning_about_the_unauthenticated_store(addr):
    warning = rendezvous_warning(addr)
    assert warning and addr in warning and "no authentication" in warning and "trusted network" in warning


def test_which_sizes_can_start_under_each_world_change_policy(tmp_path):
    """64 does not split over 3 workers. keep-global-batch never starts 3; scale-lr may be asked for
    3 (a checkpoint may exist by the time it comes to it) and starts 3 only once one does."""
    ckpt = tmp_path / "ckpt"
    keep = TrainConfig.from_flat(workload="digits", global_batch=64, checkpoint_dir=str(ckpt), resume=True)
    scale = replace(keep, checkpoint=replace(keep.checkpoint, world_change="scale-lr"))
    assert not _splits(keep, 3) and not _can_start(keep, 3) and _can_start(keep, 2)
    assert _splits(scale, 3) and not _can_start(scale, 3)
    (ckpt / "step-00000010").mkdir(parents=True)
    assert _can_start(scale, 3) and not _can_start(keep, 3)
    assert not _can_start(replace(scale, checkpoint=replace(scale.checkpoint, resume=False)), 3), (
        "a fresh start splits the configured batch"
    )
    with pytest.raises(ValueError, match="global_batch 64 is not divisible by the world size 3"):
        launch(replace(scale, checkpoint=replace(scale.checkpoint, dir=str(tmp_path / "empty"))), 3)


def test_launch_refuses_counts_past_what_the_host_holds(monkeypatch):
    monkeypatch.setattr("dpscale.cores.usable_cores", lambda: 2)
    # were the bound gone, 100000 threads would take this test process down (SIGSEGV), not fail it
    monkeypatch.setattr("dpscale.launch.launcher._launch_sizes", lambda *a: pytest.fail("workers started"))
    cfg = TrainConfig(workload="synthetic")
    with pytest.raises(ValueError, match=r"threads must be at most 8 \(4 x the 2 cores"):
        launch(cfg, 1, threads=100_000)
    with pytest.raises(ValueError, match="nproc must be at most 8"):
        launch(cfg, 16)
