"""`dpscale run`'s workers forked from the preloaded server (launch/script_main.py) run a script as
a fresh `python -u` does: each test runs tests/launch/scripts/as_main.py forked (the default) and
expects what a fresh interpreter does, stated in the test.

The cases where the two starts take different paths in dpscale run both ways (`WAYS`, the second
being DPSCALE_WORKER_START=exec), so the fallback keeps them: what reaches the script (its argv,
which the agent passes on a command line or to `fork_start.entry`; the launcher's environment,
copied by torch or handed over by `entry`; the stand-in DDP, from `run_child.main` or `forked`)
and where its output goes with a log of its own (inherited file descriptors, or the log the forked
worker opens itself). The others run forked only: their expectations are what a fresh interpreter
does, which is what an exec'd worker is (its threads follow OMP_NUM_THREADS as torch reads it at
import, its exit code is CPython's, it owes the agent no result), and `-m` is resolved to a file
by the command before any worker starts. Every case both ways had doubled the file's time, the
slowest of the main lane of `make test` (issue #28).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts the CLI and its workers

SCRIPTS = Path(__file__).parent / "scripts"
AS_MAIN = str(SCRIPTS / "as_main.py")
WAYS = ["fork", "exec"]  # for the cases whose paths differ (module doc)


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
        # what a script may never need is not preloaded for it (fork_start.SCRIPT_PRELOAD): it would cost
        # every run, the first fork waiting for it
        assert r["preloaded"] == {"torch._dynamo": False, "dpscale.train.trainer": False}
        # classes of the script pickle: in this process, into a spawned pool, into DataLoader's workers
        assert (
            r["pickled"] == "__main__" and r["spawned"] == [2, 8] and r["batches"] == [[0.0, 1.0], [4.0, 9.0]]
        )
        # multiprocessing as in a program's main process (the server's child is otherwise "forkserver")
        assert (r["start_method"], r["process"], r["parent"]) == ("fork", "MainProcess", True)
        # 2 workers: run sets 1 thread each (torch had the host's cores in the server when it imported)
        assert (r["omp"], r["threads"]) == ("1", 1)
        assert not r["torchs_ddp"]  # run_child's stand-in for torch's DDP is installed
    # `finally` blocks and atexit handlers run, in that order, on each rank
    for rank in "01":
        lines = p.stdout.splitlines()
        assert lines.index(f"finally {rank}") < lines.index(f"atexit {rank}"), p.stdout


def test_threads_follow_the_callers_omp_num_threads(tmp_path):
    # run's own setting (1 thread for each of 2 workers) is checked with the report above
    p = run("fork", ["--nproc", "1", AS_MAIN, "report"], cwd=tmp_path, env={"OMP_NUM_THREADS": "2"})
    assert p.returncode == 0, p.stderr
    assert {(r["omp"], r["threads"]) for r in reports(p.stdout)} == {("2", 2)}


def test_a_module_named_with_dash_m_runs_as_main():
    p = run("fork", ["--nproc", "1", "-m", "forked_pkg.entry", "a"], cwd=SCRIPTS)
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
# the ends that succeed, on 2 workers: a forked worker that leaves without the result torch's agent
# waits for would hang the run
SUCCESSES = {"sys.exit(0)": ["exit", "0"], "os._exit(0)": ["os_exit", "0"]}
MARK = "==== launch "


@pytest.fixture(scope="module")
def ended(tmp_path_factory) -> dict[str, tuple[int, str, str]]:
    """Each end of ENDS and SUCCESSES as `dpscale run` ends it: name -> (the command's exit code, the
    stdout and stderr of that run). One process runs them one after the other through the command's
    `main`, forking every run's workers from one server, as `dpscale scale` runs its world sizes:
    a command of its own for each would pay the command's and the server's start each time, and
    the command's first launch is what the other tests of this file run."""
    launches = {name: ("1", args) for name, (args, _, _) in ENDS.items()}
    launches |= {name: ("2", args) for name, args in SUCCESSES.items()}
    code = (
        "import sys\n"
        "from dpscale.launch import fork_start\n"
        "fork_start.start_server('dpscale.launch.run_child')  # first, as `dpscale run` does (cli/main.py)\n"
        "from dpscale.cli.main import main\n"
        f"for name, (nproc, args) in {launches!r}.items():\n"
        f"    print({MARK!r} + name, flush=True)\n"
        f"    print({MARK!r} + name, file=sys.stderr, flush=True)\n"
        f"    code = main(['run', '--nproc', nproc, {AS_MAIN!r}, *args])\n"
        "    print('exit code', code, file=sys.stderr, flush=True)\n"
        "fork_start.stop_server(remove_dir=False)  # as the command does (cli/main.py: run)\n"
    )
    environ = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    environ["DPSCALE_WORKER_START"] = "fork"
    cwd = tmp_path_factory.mktemp("ended")
    # each run takes well under a second once the server is up; a lost result would hang one
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=cwd, env=environ
    )
    assert p.returncode == 0, p.stderr
    outs, errs = _by_launch(p.stdout), _by_launch(p.stderr)
    assert list(errs) == list(launches), p.stderr
    found = {}
    for name in launches:
        last = errs[name].rstrip().splitlines()[-1]
        assert last.startswith("exit code "), errs[name]
        found[name] = (int(last.removeprefix("exit code ")), outs.get(name, ""), errs[name])
    return found


def _by_launch(text: str) -> dict[str, str]:
    """The part of `text` after each MARK line, by the launch's name."""
    parts: dict[str, list[str]] = {}
    lines: list[str] = []
    for line in text.splitlines(keepends=True):
        if line.startswith(MARK):
            lines = parts.setdefault(line[len(MARK) :].rstrip("\n"), [])
        else:
            lines.append(line)
    return {name: "".join(lines) for name, lines in parts.items()}


@pytest.mark.parametrize("end", list(ENDS))
def test_the_scripts_end_gives_pythons_exit_code(ended, end):
    args, code, said = ENDS[end]
    returned, out, err = ended[end]
    assert returned == 1, err
    assert code in err, err
    if said is not None:
        assert said in err, err
    if args[0] != "os_exit":  # os._exit skips both, as it does in a fresh interpreter
        assert "finally 0" in out and "atexit 0" in out, out


@pytest.mark.parametrize("end", list(SUCCESSES))
def test_a_script_that_exits_with_0_succeeds(ended, end):
    returned, _, err = ended[end]
    assert returned == 0, err


@pytest.mark.parametrize("way", WAYS)
def test_a_runs_log_of_its_own_gets_the_workers_output(tmp_path, way):
    """`dpscale scale` writes each run's output to a log of its own (run_script's log_path)."""
    log = tmp_path / "run.log"
    code = (
        # the server first, as `dpscale scale` starts it (cli/main.py: run)
        "from dpscale.launch import fork_start; fork_start.start_server('dpscale.launch.run_child'); "
        "import sys; from pathlib import Path; from dpscale.launch.run import run_script; "
        f"sys.exit(run_script({AS_MAIN!r}, ['raise'], nproc=2, log_path=Path({str(log)!r})))"
    )
    env = {**os.environ, "DPSCALE_WORKER_START": way}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 1, p.stderr
    text = log.read_text()
    # both workers raise at once, but the agent stops the other one as soon as one has failed: a
    # worker that had not reached its `finally` by then never prints it (seen once under load)
    assert ("finally 0" in text or "finally 1" in text) and "RuntimeError: the script's own error" in text
    assert "dpscale: error: the script failed" in text  # the command's own line, after theirs
    assert "finally" not in p.stdout + p.stderr
