"""The `dpscale` command: a thin layer over the library.

Every subcommand turns a ConfigError (bad input, dpscale.errors) into a one-line error and exit
code 2, before anything is written; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading

# nothing here imports torch: `main` installs its signal handlers before anything slow is imported
from dpscale.errors import ConfigError, UserCodeError
from dpscale.flags import add_dataclass_arguments, config_file_kwargs, dataclass_kwargs, finite_float


class _Parser(argparse.ArgumentParser):
    """argparse's own errors (a missing value, `--lr nan`) as one line too, without the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_train(sub) -> None:
    from dpscale.launch.options import LaunchOptions
    from dpscale.train.config import TrainConfig

    p = sub.add_parser(
        "train",
        help="train your task (--task module:callable) or a built-in workload with N data-parallel workers",
        description="Train your own dpscale.Task (--task module:callable) or a built-in workload "
        "(--workload, default digits) with data parallelism on this host.",
        epilog="Exit codes: 0 finished; 1 the workers failed (restarts used up); 2 bad input, refused "
        "before any worker started; 3 diverged (--max-skipped-steps); 143/138/130 stopped by "
        "SIGTERM/SIGUSR1/SIGINT after a checkpoint (continue with --resume). See docs/fault-tolerance.md.",
    )
    add_dataclass_arguments(p, LaunchOptions)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")
    add_dataclass_arguments(p, TrainConfig)
    p.set_defaults(func=_cmd_train)


def _cmd_train(args: argparse.Namespace) -> int:
    from dpscale.launch.options import LaunchOptions
    from dpscale.launch.preflight import check_config, preflight
    from dpscale.train.config import TrainConfig

    launch_opts = LaunchOptions(**dataclass_kwargs(args, LaunchOptions))
    fields = config_file_kwargs(launch_opts.config, TrainConfig) if launch_opts.config else {}
    flags = dataclass_kwargs(args, TrainConfig)
    if "task" in flags or "workload" in flags:  # a flag naming what to train replaces the file's choice
        fields.pop("task", None)
        fields.pop("workload", None)
    fields.update(flags)
    if fields.get("task") is None and fields.get("workload") is None:
        fields["workload"] = "digits"
    cfg = TrainConfig.from_flat(**fields)
    min_nproc, nproc = launch_opts.nproc_range
    nodes = launch_opts.nodes()
    check_config(cfg, [nproc, min_nproc])
    from dpscale.launch.launcher import LaunchError, RunStopped, launch
    from dpscale.train.trainer import resolve_task

    preflight(cfg, resolve_task(cfg), given=set(fields))
    try:
        result = launch(
            cfg,
            nproc,
            min_nproc=min_nproc,
            max_restarts=launch_opts.max_restarts,
            threads=launch_opts.threads,
            nodes=nodes,
        )
    except SystemExit as e:  # the task's code exited the in-process run: it trained nothing, never exit 0
        raise UserCodeError.from_exception("the task's code, during training,", e) from None
    except LaunchError as e:  # the workers ran and failed: not bad input, so exit 1 with their traceback
        print(f"dpscale train: error: {e}", file=sys.stderr, flush=True)
        return 1
    except RunStopped as e:  # diverged (3) or stopped by a signal (143, 130): one line, its own code
        print(f"dpscale train: {e}", file=sys.stderr, flush=True)
        if args.json and e.result is not None:
            print(json.dumps(e.result.to_dict()), flush=True)
        return e.exit_code
    if args.json:
        print(json.dumps(result.to_dict()), flush=True)
    return 0


def _command(sub, name: str, text: str, add_arguments, run) -> None:
    """Register one subcommand: its flags from `add_arguments`, its body `run(args) -> exit code`."""
    p = sub.add_parser(name, help=text, description=text)
    add_arguments(p)
    p.set_defaults(func=run)


def _add_lab(sub) -> None:
    from dpscale.cli import bench, report
    from dpscale.lab.bench import script_scaling_report

    bench.register(sub)
    _command(
        sub,
        "study",
        "the main job: all-reduce, weak scaling and convergence, one report",
        report.add_study_arguments,
        report.run_study,
    )
    _command(
        sub,
        "report",
        "re-render one report directory, or compare several (A/B)",
        report.add_report_arguments,
        report.run_report,
    )
    _command(sub, "scale", script_scaling_report.BENCH.help, bench.add_scale_arguments, bench.run_scale)


def _add_check(sub) -> None:
    from dpscale.cli import check

    check.register(sub)


def _add_predict(sub) -> None:
    from dpscale.cli import predict as predict_cli

    _command(
        sub,
        "profile",
        "measure one worker's step: compute phases, bucket ready times, bytes",
        predict_cli.add_profile_arguments,
        predict_cli.run_profile_from_args,
    )
    _command(
        sub,
        "predict",
        "predict throughput and scaling efficiency on a cluster you describe",
        predict_cli.add_predict_arguments,
        predict_cli.run_predict_from_args,
    )


def _add_run(sub) -> None:
    p = sub.add_parser(
        "run",
        help="run your torchrun script unchanged, with dpscale's engine standing in for torch's DDP",
        description="Run SCRIPT on N local workers as `torchrun --standalone` would, with dpscale's "
        "engine standing in for torch.nn.parallel.DistributedDataParallel (the script is not changed).",
    )
    from dpscale.cli.module import ModuleFlag
    from dpscale.launch.run import RunConfig

    add_dataclass_arguments(p, RunConfig, aliases={"nproc": ("--nproc-per-node",)})  # torchrun's spelling
    add_dataclass_arguments(p, ModuleFlag)
    p.add_argument("script", metavar="SCRIPT", help="your training script")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="its arguments")
    p.set_defaults(func=_cmd_run)


def _cmd_run(args: argparse.Namespace) -> int:
    from dpscale.cli.module import module_file
    from dpscale.launch.run import RunConfig, run_script

    config = RunConfig(**dataclass_kwargs(args, RunConfig))
    script = module_file(args.script) if args.module else args.script
    return run_script(
        script,
        args.args,
        nproc=config.nproc,
        engine=config.engine,
        trace=config.window,
        trace_dir=config.trace,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dpscale", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_lab(sub)
    _add_check(sub)
    _add_predict(sub)
    _add_run(sub)
    _refuse_non_finite(parser)
    return parser


def _refuse_non_finite(parser: argparse.ArgumentParser) -> None:
    """Every float flag of every subcommand refuses nan and inf while parsing (exit 2): a
    non-finite number passes most range checks (nan < 0 is false) and fails much later."""
    for action in parser._actions:
        if action.type is float:
            action.type = finite_float
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                _refuse_non_finite(subparser)


def _version() -> str:
    from dpscale.version import __version__

    return f"dpscale {__version__}"


def main(argv: list[str] | None = None, *, start_workers_server: bool = False) -> int:
    """Run `dpscale ARGV` (default: sys.argv[1:]) in this process; its exit code.

    `start_workers_server`: as the command does (run()), start the workers' fork server first where
    the flags say workers will start (launch/fork_start.py); not for calls from other code, which
    would be left with a server."""
    from dpscale.launch.process_life import (
        Interrupted,
        interrupt_on_signals,
        release_held_signals,
        restore_signals,
        signals_deferred,
    )

    # before anything slow: a signal from here on ends what the command started and says so
    # (train's launcher turns SIGTERM, SIGUSR1 and SIGINT into a stop request while it trains)
    previous = interrupt_on_signals() if threading.current_thread() is threading.main_thread() else {}
    words = sys.argv[1:] if argv is None else argv
    try:
        # inside the try: a signal the entry point held since the command's start is raised here
        release_held_signals()
        if start_workers_server:
            from dpscale.launch import fork_start

            if fork_start.starts_workers(words):
                # before anything imports torch: the server imports it on the other core meanwhile;
                # whole, so that run() knows the server to end whenever a signal comes
                with signals_deferred():
                    fork_start.start_server(fork_start.worker_module(words))
        # whole too: torch's C++ part imports numpy and drops an exception raised meanwhile (a
        # signal's: the command went on training) or leaves numpy half imported (the next import of
        # it fails); every command imports torch anyway (build_parser)
        with signals_deferred():
            import torch  # noqa: F401
        return _main(argv)
    except Interrupted as e:  # what the command started is ended already (launch/job.py)
        print(f"{' '.join(['dpscale', *words[:1]])}: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    finally:
        restore_signals(previous)


def _main(argv: list[str] | None) -> int:
    from dpscale.launch.job import job_scope

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        # every process the command starts, and every temp file, is part of one job (launch/job.py)
        with job_scope():
            return int(args.func(args) or 0)
    except ConfigError as e:  # a verdict on the input; any other exception is a bug, shown in full
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"dpscale {args.command}: error: {msg}", file=sys.stderr)
        if isinstance(e, UserCodeError) and e.user_traceback:  # their bug, in their own frames only
            print(e.user_traceback, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def run() -> None:
    """The `dpscale` command, once its entry point (src/_dpscale_cli.py) has held the stopping
    signals: main(), then exit with its code.

    `dpscale train` leaves through os._exit once its output is flushed: a process that trained
    keeps torch's gloo threads alive past destroy_process_group (torch._dynamo, imported with the
    optimizer, holds the group), and one of them needing the GIL during interpreter shutdown can
    abort a run that succeeded (see dpscale/launch/process_life.py). Other commands exit normally.
    """
    code = main(start_workers_server=True)
    from dpscale.launch import fork_start

    if sys.argv[1:2] == ["train"]:
        from dpscale.launch.process_life import exit_now

        fork_start.stop_server()
        exit_now(code)
    fork_start.stop_server(remove_dir=False)  # if one started (a no-op otherwise); sys.exit removes it
    sys.exit(code)


if __name__ == "__main__":
    run()
