"""dpscale's messages to the user go through Python's logging, logger "dpscale", never print().

Library code logs with `logger = get_logger(__name__)` (a child of "dpscale"); what a command prints
as its result (tables, JSON, the report's path) is the CLI's and stays print. By default the
logger writes "dpscale: <message>" lines ("dpscale: warning: <message>" for a warning) to stderr
at INFO and above, and only from rank 0:
messages that every rank would repeat (the transport chosen, a checkpoint rejected) are said once.
A process is rank 0 unless torch's launcher (or dpscale's) set RANK to another number.

Change it the usual ways:
    logging.getLogger("dpscale").setLevel(logging.WARNING)   # warnings and errors only
    logging.getLogger("dpscale").setLevel(logging.CRITICAL + 1)  # silent
    dpscale.log.use_my_handlers()                             # to your own handlers (propagate)
    DPSCALE_LOG_ALL_RANKS=1                                   # every rank's, "dpscale[rank 3]: ..."
"""

from __future__ import annotations

import logging
import os
import sys

NAME = "dpscale"


def workers(n: int) -> str:
    """ "1 worker", "2 workers": the count in a message."""
    return f"{n} worker" if n == 1 else f"{n} workers"


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class _Stderr(logging.StreamHandler):
    """A handler on whatever sys.stderr is when a record comes (pytest, redirect_stderr)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ sets it; the property wins
        pass


class _RankFormat(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        rank = _rank()
        where = NAME if rank == 0 else f"{NAME}[rank {rank}]"
        level = f"{record.levelname.lower()}: " if record.levelno >= logging.WARNING else ""
        return f"{where}: {level}{record.getMessage()}"


class _RankZero(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _rank() == 0 or os.environ.get("DPSCALE_LOG_ALL_RANKS") == "1"


def _install() -> logging.Logger:
    logger = logging.getLogger(NAME)
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        handler = _Stderr()
        handler.setFormatter(_RankFormat())
        handler.addFilter(_RankZero())
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        # dpscale's own handler says each message once; an application's root handlers would
        # repeat it (use_my_handlers hands the messages to them instead)
        logger.propagate = False
    return logger


def get_logger(name: str) -> logging.Logger:
    """The logger of dpscale module `name` (`__name__`), under "dpscale" and its default handler."""
    return logging.getLogger(name)


def use_my_handlers() -> None:
    """Send dpscale's messages to the application's logging configuration instead of stderr."""
    logger = logging.getLogger(NAME)
    for h in [h for h in logger.handlers if isinstance(h, _Stderr)]:
        logger.removeHandler(h)
    logger.propagate = True


_install()  # once, at the first import: use_my_handlers() stays undone by no later import
