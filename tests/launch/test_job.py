"""A job's directory outlives a command that died before its reaper started; the next job removes it,
and only it: the command is named by its pid and start time, since in a shared /tmp a dead
command's pid may belong to another process by then (#34 review)."""

import os
from pathlib import Path

from dpscale.launch import job


def process_start_time(pid: int) -> int:
    """Field 22 of /proc/PID/stat (read here, not through the code under test)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def _job_dir(tmp_path, owner: str):
    path = tmp_path / f"dpscale-job-{owner}-x1y2z3_a"
    path.mkdir()
    return path


def test_a_stale_job_dir_whose_pid_now_belongs_to_another_process_is_removed(tmp_path):
    me, started = os.getpid(), process_start_time(os.getpid())
    reused = _job_dir(tmp_path, f"{me}-{started + 1}")  # the pid is alive, but not the process that wrote it
    live = _job_dir(tmp_path, f"{me}-{started}")
    job._remove_stale(tmp_path)
    assert not reused.exists()
    assert live.exists()


def test_a_job_dir_named_by_pid_alone_goes_only_when_the_pid_is_gone(tmp_path):
    dead_pid = 2**22 + 7  # above Linux's pid_max: no process has it
    gone, kept = _job_dir(tmp_path, str(dead_pid)), _job_dir(tmp_path, str(os.getpid()))
    job._remove_stale(tmp_path)
    assert not gone.exists() and kept.exists()


def test_a_job_dir_carries_its_commands_pid_and_start_time(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with job.job_scope() as scope:
        name = scope.directory.name
    assert name.startswith(f"dpscale-job-{os.getpid()}-{process_start_time(os.getpid())}-")
