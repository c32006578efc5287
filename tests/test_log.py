"""The library logs (logger "dpscale", rank 0 by default) and never prints; the CLI prints results."""

import ast
import logging
from pathlib import Path

import pytest

from dpscale import log

SRC = Path(__file__).resolve().parents[1] / "src" / "dpscale"
# What a command shows as its result (tables, JSON lines, the report's path) is printed by the CLI
# layer; the training progress and the worker's result line are output the user asked for.
PRINTS_ALLOWED = {
    "cli/main.py",
    "cli/bench.py",
    "cli/check.py",
    "cli/predict.py",
    "cli/report.py",
    "flags.py",  # the command line's own notices (a deprecated flag spelling), as argparse's errors
    "train/metrics.py",
    "launch/worker.py",
}


def test_the_library_does_not_print():
    printing = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel in PRINTS_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                printing.append(f"{rel}:{node.lineno}")
    assert not printing, f"log through dpscale.log.get_logger(__name__) instead of print: {printing}"


@pytest.fixture
def dpscale_logger(monkeypatch):
    logger = logging.getLogger(log.NAME)
    level, disabled = logger.level, logger.disabled
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("DPSCALE_LOG_ALL_RANKS", raising=False)
    yield log.get_logger("dpscale.lab.bench.example")
    logger.setLevel(level)
    logger.disabled = disabled


def test_messages_go_to_stderr_once_from_rank_0(dpscale_logger, capsys, monkeypatch):
    dpscale_logger.info("transport %s", "shm")
    dpscale_logger.warning("world size %d > %d cores", 4, 2)
    assert capsys.readouterr().err == "dpscale: transport shm\ndpscale: warning: world size 4 > 2 cores\n"
    monkeypatch.setenv("RANK", "3")  # another rank: said by rank 0 already
    dpscale_logger.warning("again")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("DPSCALE_LOG_ALL_RANKS", "1")
    dpscale_logger.info("from every rank")
    assert capsys.readouterr().err == "dpscale[rank 3]: from every rank\n"


def test_the_usual_means_silence_it(dpscale_logger, capsys):
    logging.getLogger("dpscale").setLevel(logging.WARNING)
    dpscale_logger.info("chatter")
    dpscale_logger.warning("kept")
    assert capsys.readouterr().err == "dpscale: warning: kept\n"
    logging.getLogger("dpscale").setLevel(logging.CRITICAL + 1)
    dpscale_logger.error("nothing")
    assert capsys.readouterr().err == ""


def test_an_application_can_take_the_messages_into_its_own_logging(dpscale_logger, capsys, caplog):
    logger = logging.getLogger("dpscale")
    handlers = list(logger.handlers)
    try:
        log.use_my_handlers()
        with caplog.at_level(logging.INFO):
            dpscale_logger.info("to the application")
        assert capsys.readouterr().err == ""
        assert "to the application" in [r.getMessage() for r in caplog.records]
    finally:
        logger.handlers[:] = handlers
        logger.propagate = False


def test_a_count_of_workers_reads_as_english():
    from dpscale.log import workers

    assert (workers(1), workers(2), workers(0)) == ("1 worker", "2 workers", "0 workers")
