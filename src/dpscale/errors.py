"""`ConfigError`: bad input, as opposed to a bug.

Raised for a configuration value, a flag, or a file the user named that cannot be used; the
message names the field or flag and says what to change. It is a ValueError, so code that catches
ValueError keeps working; the CLI prints it as one line with exit code 2 and shows any other
exception with its traceback (a bug to report, not input to fix).
"""


class ConfigError(ValueError):
    """Bad input: the message names the field, flag or file and the fix."""


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
