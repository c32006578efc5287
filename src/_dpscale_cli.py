"""The `dpscale` command's entry point (pyproject's [project.scripts]): the first of dpscale's code
a command runs, so that a signal in its first moments ends it with its one line, as a later one does.

It lies outside the dpscale package because importing any module of the package runs the package's
`__init__` first, which takes a few times the interpreter's own start (docs/fault-tolerance.md,
"Signals in a command's first moments"). It holds (blocks) the signals that stop a command and
hands over to dpscale.cli.main, which lets them through once its handlers are in place: one that
came meanwhile is then delivered, and the command ends the one way it always does. A signal that
arrives before this module runs, while the interpreter itself starts, gets the signal's default
action: no line, but nothing of the command has started either.
"""

# the builtin module: `signal` would first import enum and functools, which lengthens the window
import _signal

# the signals dpscale.launch.process_life.INTERRUPTING turns into a command's one line
_HELD = (_signal.SIGTERM, _signal.SIGINT, _signal.SIGHUP, _signal.SIGUSR1)


def run() -> None:
    """The `dpscale` command: hold the stopping signals, then dpscale.cli.main.run().

    Held, not handled here: the kernel keeps a signal pending, so a command has one way of
    stopping, not a second one for its first moments. A blocked mask is inherited by the processes
    a command starts; cli.main lets the signals through before it starts any."""
    _signal.pthread_sigmask(_signal.SIG_BLOCK, _HELD)
    from dpscale.cli.main import run as run_command

    run_command()
