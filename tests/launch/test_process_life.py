"""A worker process's life (process_life.py): it dies with its parent, turns a signal into a stop
request, and leaves through os._exit with its output flushed."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dpscale.launch.process_life import (
    INTERRUPTING,
    Interrupted,
    StopRequest,
    interrupt_on_signals,
    restore_signals,
    signal_exit_code,
    signals_deferred,
)


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_a_child_that_calls_die_with_parent_ends_when_its_parent_is_killed(tmp_path):
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
                import subprocess, sys, time
                code = (
                    "import os, time; from dpscale.launch.process_life import die_with_parent; "
                    "die_with_parent(os.getppid()); open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
                    "time.sleep(600)"
                )
                subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
                time.sleep(600)
            """),
        ]
    )
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(pid_file.read_text())
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the child outlived its parent"
    finally:
        parent.kill()
        if pid_file.exists() and pid_file.read_text() and _alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_an_agent_started_through_guarded_module_ends_with_the_command_that_started_it(tmp_path, sig):
    # what `dpscale run`, `scale` and the benches across hosts do with torchrun's agent
    pid_file = tmp_path / "agent.pid"
    (tmp_path / "sleeper.py").write_text(
        f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n"
    )
    code = (
        "import subprocess, time; from dpscale.launch.process_life import guarded_module; "
        "subprocess.Popen(guarded_module('sleeper'), start_new_session=True); time.sleep(600)"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    command = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        agent = int(pid_file.read_text())
        command.send_signal(sig)
        command.wait()
        deadline = time.monotonic() + 5
        while _alive(agent) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(agent), "the agent outlived the command that started it"
    finally:
        command.kill()
        if pid_file.exists() and pid_file.read_text() and _alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_the_first_signal_is_a_request_and_the_second_is_passed_on():
    seen = []
    stop = StopRequest(on_request=seen.append, on_second=seen.append).install()
    try:
        assert stop() is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop() == "SIGTERM" and seen == ["SIGTERM"]
        os.kill(os.getpid(), signal.SIGINT)
        assert seen == ["SIGTERM", signal.SIGINT]
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert (signal_exit_code("SIGTERM"), signal_exit_code("SIGINT")) == (143, 130)


def test_a_signal_while_signals_are_deferred_is_raised_once_the_block_is_done():
    # the workers' server starts in such a block (cli/main.py): cut in half, it would be left running
    previous = interrupt_on_signals()
    try:
        finished = False
        with pytest.raises(Interrupted) as stopped:
            with signals_deferred():
                os.kill(os.getpid(), signal.SIGUSR1)
                time.sleep(0.01)  # Python runs the handler here, between two bytecodes
                finished = True
        assert finished and stopped.value.name == "SIGUSR1"
        assert signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL  # the handler before is back
        with pytest.raises(Interrupted):  # and raises at once again
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.01)
    finally:
        restore_signals(previous)


@pytest.mark.slow
def test_the_entry_point_holds_exactly_the_signals_the_command_releases():
    # src/_dpscale_cli.py cannot import the package for its list (that is its point): a signal it
    # held but release_held_signals does not unblock would stay blocked in every worker
    import _dpscale_cli

    assert set(_dpscale_cli._HELD) == set(INTERRUPTING)


@pytest.mark.slow  # starts a process
def test_exit_now_flushes_and_keeps_the_exit_code():
    code = "import sys; from dpscale.launch.process_life import exit_now; print('done', end=''); exit_now(3)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout) == (3, "done")


@pytest.mark.slow
def test_worker_help_exits_0():
    # argparse's --help ends main with SystemExit(0); torch's @record turns that into None
    p = subprocess.run(
        [sys.executable, "-m", "dpscale.launch.worker", "--help"], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    assert "usage" in p.stdout
