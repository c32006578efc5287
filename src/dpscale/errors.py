"""`ConfigError`: bad input, as opposed to a bug.

Raised for a configuration value, a flag, or a file the user named that cannot be used; the
message names the field or flag and says what to change. It is a ValueError, so code that catches
ValueError keeps working; the CLI prints it as one line with exit code 2 and shows any other
exception with its traceback (a bug to report, not input to fix).
"""


class ConfigError(ValueError):
    """Bad input: the message names the field, flag or file and the fix."""
