"""`ConfigError`: bad input, as opposed to a bug.

Raised for a configuration value, a flag, or a file the user named that cannot be used; the
message names the field or flag and says what to change. It is a ValueError, so code that catches
ValueError keeps working; the CLI prints it as one line with exit code 2 and shows any other
exception with its traceback (a bug to report, not input to fix).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad input: the message names the field, flag or file and the fix."""


class UserCodeError(ConfigError):
    """The user's own code (their Task, its model, their module) raised or exited: the message is
    one line naming what failed (`Task.model()`, `forward`, the import of `mytask`);
    `user_traceback` holds the traceback's frames from the user's own files only, which the CLI
    prints under that line (dpscale's and torch's frames would hide the bug among 30 lines)."""

    def __init__(self, message: str, user_traceback: str = ""):
        super().__init__(message)
        self.user_traceback = user_traceback

    @classmethod
    def from_exception(cls, what: str, error: BaseException) -> UserCodeError:
        """`what` raised (or exited through) `error`: one line, then the user's frames."""
        if isinstance(error, SystemExit):
            line = f"{what} called sys.exit({error.code!r}); a task must return, not exit the process"
        else:
            text = str(error).strip()
            reason = text.splitlines()[0] if text else ""
            line = f"{what} raised {type(error).__name__}" + (f": {reason}" if reason else "")
        return cls(line, user_frames(error))


def user_frames(error: BaseException) -> str:
    """The traceback of `error` cut to the frames of the user's own files (not Python's, not an
    installed package's, not dpscale's), with the exception's last line; "" when none is theirs."""
    import os
    import sysconfig
    import traceback

    here = os.path.dirname(os.path.abspath(__file__))
    theirs = tuple(
        os.path.realpath(p)
        for p in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    )
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if not f.filename.startswith("<") and not os.path.realpath(f.filename).startswith((*theirs, here))
    ]
    if not frames:
        return ""
    lines = ["Traceback (your code only, most recent call last):", *traceback.format_list(frames)]
    lines += traceback.format_exception_only(type(error), error)
    return "".join(line if line.endswith("\n") else line + "\n" for line in lines).rstrip("\n")


def import_extra(module: str, purpose: str):
    """`module`, imported; a ConfigError naming the extra to install when it is not there.

    The engine needs torch and numpy only; plots (matplotlib), the `digits` data (scikit-learn)
    and the progress bar (rich) come with `pip install 'dpscale[lab]'`, which `make` installs."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        package = {"sklearn": "scikit-learn"}.get(module.split(".")[0], module.split(".")[0])
        raise ConfigError(
            f"{purpose} needs {package}, part of dpscale's lab extra: pip install 'dpscale[lab]'"
        ) from None
