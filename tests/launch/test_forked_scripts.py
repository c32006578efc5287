"""`dpscale run`'s workers forked from the preloaded server (launch/script_main.py) run a script as
a fresh `python -u` does: each test runs tests/launch/scripts/as_main.py both ways (the default,
forked, and DPSCALE_WORKER_START=exec) and expects the same, stated, behaviour of each."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts the CLI and its workers

SCRIPTS = Path(__file__).parent / "scripts"
AS_MAIN = str(SCRIPTS / "as_main.py")
WAYS = ["fork", "exec"]


def run(way, args, *, cwd, env=None, timeout=240):
    environ = {**os.environ, "DPSCALE_WORKER_START": way, **(env or {})}
    environ.pop("OMP_NUM_THREADS", None) if "OMP_NUM_THREADS" not in (env or {}) else None
    return subprocess.run(
        [sys.executable, "-m", "dpscale.cli.main", "run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=environ,
    )


def reports(stdout):
    return sorted(
        (json.loads(line) for line in stdout.splitlines() if line.startswith("{")), key=lambda r: r["rank"]
    )


@pytest.mark.parametrize("way", WAYS)
def test_the_script_runs_as_main_with_its_argv_path_and_environment(tmp_path, way):
    p = run(way, ["--nproc", "2", AS_MAIN, "report", "x y"], cwd=tmp_path, env={"AS_MAIN_VAR": "set"})
    assert p.returncode == 0, p.stderr
    found = reports(p.stdout)
    assert [r["rank"] for r in found] == ["0", "1"], p.stdout
    for r in found:
        assert r["argv"] == [AS_MAIN, "report", "x y"]  # torchrun's sys.argv: the script, its arguments
        assert r["path0"] == str(SCRIPTS) and r["file"] == AS_MAIN and r["name"] == "__main__"
        assert r["world"] == "2" and r["launcher_var"] == "set"  # the agent's variables and the command's
        # classes of the script pickle: in this process, into a spawned pool, into DataLoader's workers
        assert (
            r["pickled"] == "__main__" and r["spawned"] == [2, 8] and r["batches"] == [[0.0, 1.0], [4.0, 9.0]]
        )
        # multiprocessing as in a program's main process (the server's child is otherwise "forkserver")
        assert (r["start_method"], r["process"], r["parent"]) == ("fork", "MainProcess", True)
        assert not r["torchs_ddp"]  # run_child's stand-in for torch's DDP is installed
    # `finally` blocks and atexit handlers run, in that order, on each rank
    for rank in "01":
        lines = p.stdout.splitlines()
        assert lines.index(f"finally {rank}") < lines.index(f"atexit {rank}"), p.stdout


@pytest.mark.parametrize("way", WAYS)
def test_threads_follow_the_workers_omp_num_threads(tmp_path, way):
    # 2 workers: run sets 1 thread each (torch had the host's cores in the server when it imported)
    p = run(way, ["--nproc", "2", AS_MAIN, "report"], cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert {(r["omp"], r["threads"]) for r in reports(p.stdout)} == {("1", 1)}
    p = run(way, ["--nproc", "1", AS_MAIN, "report"], cwd=tmp_path, env={"OMP_NUM_THREADS": "2"})
    assert p.returncode == 0, p.stderr
    assert {(r["omp"], r["threads"]) for r in reports(p.stdout)} == {("2", 2)}


@pytest.mark.parametrize("way", WAYS)
def test_a_module_named_with_dash_m_runs_as_main(tmp_path, way):
    p = run(way, ["--nproc", "1", "-m", "forked_pkg.entry", "a"], cwd=SCRIPTS)
    assert p.returncode == 0, p.stderr
    assert "module __main__ True ['a']" in p.stdout


# (arguments, exit code the agent reports, what stderr holds): as `python -u SCRIPT` ends
ENDS = {
    "raise": (["raise"], "exitcode  : 1", "RuntimeError: the script's own error"),
    "exit 3": (["exit", "3"], "exitcode  : 3", None),
    "exit message": (["exit", "bye"], "exitcode  : 1", "bye"),
    "interrupt": (["interrupt"], "exitcode  : -2", "KeyboardInterrupt"),
    "os._exit 4": (["os_exit", "4"], "exitcode  : 4", None),
}


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("end", list(ENDS))
def test_the_scripts_end_gives_pythons_exit_code(tmp_path, way, end):
    args, code, said = ENDS[end]
    p = run(way, ["--nproc", "1", AS_MAIN, *args], cwd=tmp_path)
    assert p.returncode == 1, p.stderr
    assert code in p.stderr, p.stderr
    if said is not None:
        assert said in p.stderr, p.stderr
    if args[0] != "os_exit":  # os._exit skips both, as it does in a fresh interpreter
        assert "finally 0" in p.stdout and "atexit 0" in p.stdout, p.stdout


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("args", [["exit", "0"], ["os_exit", "0"]], ids=["sys.exit(0)", "os._exit(0)"])
def test_a_script_that_exits_with_0_succeeds(tmp_path, way, args):
    p = run(way, ["--nproc", "2", AS_MAIN, *args], cwd=tmp_path, timeout=120)  # a lost result would hang
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("way", WAYS)
def test_a_runs_log_of_its_own_gets_the_workers_output(tmp_path, way):
    """`dpscale scale` writes each run's output to a log of its own (run_script's log_path)."""
    log = tmp_path / "run.log"
    code = (
        "import sys; from pathlib import Path; from dpscale.launch.run import run_script; "
        f"sys.exit(run_script({AS_MAIN!r}, ['raise'], nproc=2, log_path=Path({str(log)!r})))"
    )
    env = {**os.environ, "DPSCALE_WORKER_START": way}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 1, p.stderr
    text = log.read_text()
    assert "finally 0" in text and "finally 1" in text and "RuntimeError: the script's own error" in text
    assert "dpscale: error: the script failed" in text  # the command's own line, after theirs
    assert "finally" not in p.stdout + p.stderr
