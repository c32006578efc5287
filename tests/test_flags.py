"""Flags come from config dataclasses (flags.py): one flag per field, and no command hand-writes its own."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from dpscale.cli.main import build_parser, main
from dpscale.errors import ConfigError
from dpscale.flags import add_dataclass_arguments, dataclass_kwargs
from dpscale.lab.predict.profile import ProfileConfig
from dpscale.lab.predict.profiling import measure
from dpscale.launch.run import RunConfig, run_script

# Flags that say how to show a result, not what to run: no config field behind them; and
# --config FILE.toml, which sets the config's own fields from a file (flags.config_file_kwargs).
OUTPUT_FLAGS = {"--json", "--report-dir", "--config"}


def _hand_written(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _hand_written(sub, (*path, name))
        elif action.option_strings and not isinstance(action, argparse._HelpAction | argparse._VersionAction):
            if getattr(action, "config_field", None) is None:
                yield " ".join(path), action.option_strings[0]


def test_every_flag_is_generated_from_a_config_field():
    from dpscale.launch import worker

    found: dict[str, set[str]] = {}
    walks = [_hand_written(build_parser()), _hand_written(worker.build_parser(), ("train.worker",))]
    for command, flag in (found_flag for walk in walks for found_flag in walk):
        if flag not in OUTPUT_FLAGS:
            found.setdefault(command, set()).add(flag)
    assert not found, (
        f"make these fields of the command's config dataclass (flags.add_dataclass_arguments): {found}"
    )


def test_a_hand_written_flag_is_found():
    # the check above must be able to fail: a flag added with add_argument carries no config field
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, _Example)
    parser.add_subparsers().add_parser("sub").add_argument("--by-hand")
    assert list(_hand_written(parser)) == [("sub", "--by-hand")]


def test_a_choice_field_is_checked_by_argparse_and_by_its_config(capsys):
    from dpscale.cli.bench import ConvergenceMode

    with pytest.raises(SystemExit) as e:
        main(["bench", "convergence", "--mode", "strong"])
    assert e.value.code == 2 and "--mode: invalid choice: 'strong'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="^--mode: unknown 'strong'; choose one of same-batch, weak$"):
        ConvergenceMode(mode="strong")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Example:
    name: str
    """Required: no default."""
    count: int = 2
    """How many."""


def test_a_field_without_default_is_a_required_flag_and_unset_flags_keep_the_default(capsys):
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, _Example)
    with pytest.raises(SystemExit) as e:
        parser.parse_args([])
    assert e.value.code == 2 and "--name" in capsys.readouterr().err
    config = _Example(**dataclass_kwargs(parser.parse_args(["--name", "x"]), _Example))
    assert config == _Example(name="x", count=2)
    assert "How many. (default: 2)" in parser.format_help()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--nproc", "0", "train.py"], "--nproc must be at least 1, got 0"),
        (["run", "--engine", "horovod", "train.py"], "--engine: unknown 'horovod'"),
        (["profile", "--model", "mlp", "--steps", "0"], "--steps: must be >= 1, got 0"),
        (["profile", "--model", "mlp", "--co-located", "0"], "--co-located: must be >= 1, got 0"),
        (["train", "--nproc", "3:2"], "--nproc must be N or MIN:MAX with 1 <= MIN <= MAX, got '3:2'"),
        (["train", "--max-restarts", "-1"], "--max-restarts must be >= 0, got -1"),
        (["train", "--threads", "0"], "--threads must be >= 1"),
        (
            ["train", "--rdzv-id", "job"],
            "--rdzv-endpoint, --rdzv-id, --local-addr, --rdzv-conf and --node-rank need --nnodes",
        ),
        (["train", "--node-rank", "1"], "--node-rank need --nnodes"),
        (
            ["train", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400", "--rdzv-id", "j"]
            + ["--node-rank", "2"],
            "--node-rank must be 0..1 for --nnodes 2, got 2",
        ),
        (["train", "--nnodes", "2", "--rdzv-id", "job"], "--nnodes needs --rdzv-endpoint HOST:PORT"),
    ],
)
def test_bad_flags_exit_2_with_the_flag_named(argv, message, capsys):
    assert main(argv) == 2  # refused before any process starts (this tier forbids starting one)
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err, err


def test_profile_needs_a_model(capsys):
    with pytest.raises(SystemExit) as e:
        main(["profile"])
    assert e.value.code == 2 and "--model" in capsys.readouterr().err


def test_train_launcher_flags_build_launch_options():
    from dpscale.launch.options import LaunchOptions

    args = build_parser().parse_args(
        ["train", "--nproc", "1:2", "--nnodes", "2", "--rdzv-endpoint", "h:29400", "--rdzv-id", "j"]
    )
    opts = LaunchOptions(**dataclass_kwargs(args, LaunchOptions))
    assert opts.nproc_range == (1, 2) and (opts.max_restarts, opts.threads, opts.config) == (0, None, None)
    nodes = opts.nodes()
    assert (nodes.min_nodes, nodes.max_nodes, nodes.rdzv_endpoint, nodes.rdzv_id) == (2, 2, "h:29400", "j")
    assert LaunchOptions().nodes() is None
    assert "--config FILE.toml" in build_parser()._subparsers._group_actions[0].choices["train"].format_help()


def test_the_library_checks_what_the_flags_check():
    with pytest.raises(ConfigError, match="--nproc"):
        run_script("train.py", [], nproc=0)
    with pytest.raises(ConfigError, match="--warmup"):
        measure("mlp", 8, warmup=-1)
    assert RunConfig() == RunConfig(nproc=1, engine="dpscale")
    assert ProfileConfig(model="mlp").per_worker_batch == 64


def test_a_field_with_a_group_is_listed_under_it():
    from dpscale.flags import flag_spec

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Grouped:
        alone: int = 1
        """Not in a group."""
        inside: float = dataclasses.field(default=0.5, metadata=flag_spec(group="cluster"))
        """In the cluster group."""

    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, Grouped)
    (group,) = [g for g in parser._action_groups if g.title == "cluster"]
    assert [a.dest for a in group._group_actions] == ["inside"]
    assert Grouped(**dataclass_kwargs(parser.parse_args(["--inside", "2"]), Grouped)).inside == 2.0


def test_predict_keeps_its_flags_and_defaults():
    from dpscale.lab.predict.options import PredictOptions

    parser = build_parser()
    args = parser.parse_args(["predict", "--params", "1e6", "--step-compute-ms", "5", "--no-congestion"])
    opts = PredictOptions(**dataclass_kwargs(args, PredictOptions))
    assert (opts.params, opts.step_compute_ms, opts.no_congestion, opts.no_stragglers) == (
        1e6,
        5.0,
        True,
        False,
    )
    assert (opts.preset, opts.bucket_mb, opts.algorithm, opts.engine) == ("cpu-shm", 25.0, "auto", "dpscale")
    assert (opts.bytes_per_param, opts.backward_fraction, opts.oversubscription) == (4.0, 2 / 3, 1.0)
    assert args.report_dir == "reports" and args.json is False


def test_train_config_file_reads_through_the_one_toml_reader(tmp_path, capsys):
    from dpscale.flags import config_file_kwargs
    from dpscale.train.config import TrainConfig

    path = tmp_path / "run.toml"
    path.write_text('workload = "synthetic"\nglobal-batch = 32\nmax_steps = 5\n')
    assert config_file_kwargs(str(path), TrainConfig) == {
        "workload": "synthetic",
        "global_batch": 32,
        "max_steps": 5,
    }
    path.write_text("global_bach = 32\n")
    assert main(["train", "--config", str(path)]) == 2  # refused before a worker starts
    assert "--config: " in capsys.readouterr().err


def test_the_torchrun_worker_refuses_bad_threads_in_one_line(capsys):
    from dpscale.launch import worker

    with pytest.raises(SystemExit) as e:
        worker.main(["--threads", "0"])  # refused before the process group or any worker starts
    err = capsys.readouterr().err.strip()
    assert (
        e.value.code == 2 and err == "python -m dpscale.launch.worker: error: --threads must be >= 1, got 0"
    )
    assert worker.WorkerOptions().threads == 1


def test_the_torchrun_worker_refuses_more_threads_than_the_host_holds(capsys, monkeypatch):
    from dpscale.launch import worker

    monkeypatch.setattr("dpscale.cores.usable_cores", lambda: 2)
    # were the bound gone, 100000 threads would take this test process down (SIGSEGV), not fail it
    monkeypatch.setattr(worker, "die_with_parent", lambda pid: None)
    monkeypatch.setattr(worker, "run_worker", lambda *a: pytest.fail("the worker started"))
    with pytest.raises(SystemExit) as e:
        worker.main(["--threads", "100000"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--threads must be at most 8" in err[0], err


def test_a_reports_config_is_rebuilt_without_its_checks_and_with_todays_defaults():
    from dpscale.flags import unchecked_config

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Recorded:
        sizes: tuple[int, ...] = (1, 2)
        added_later: int = 7
        names: list[str] = dataclasses.field(default_factory=lambda: ["a"])

        def __post_init__(self):
            raise AssertionError("an old report's config is not validated again")

    config = unchecked_config(Recorded, {"sizes": [4, 8], "names": ["b"]})
    assert (config.sizes, config.added_later, config.names) == ((4, 8), 7, ["b"])
    assert dataclasses.asdict(config) == {"sizes": (4, 8), "added_later": 7, "names": ["b"]}


# ---- one vocabulary: --nproc and --engines everywhere; old spellings work with a deprecation line


def _vocabulary_cases():
    from dpscale.cli.module import ModuleFlag
    from dpscale.lab.bench import allreduce, convergence, engines, scaling, script_scaling, study
    from dpscale.lab.check.equivalence import EquivalenceCheckConfig

    return [
        (["bench", "allreduce"], allreduce.AllReduceConfig, "--nproc", "--world-sizes", "1,2"),
        (["bench", "scaling"], scaling.ScalingConfig, "--nproc", "--world-sizes", "1,2"),
        (["bench", "convergence"], convergence.ConvergenceConfig, "--nproc", "--world-sizes", "1,2"),
        (["bench", "engine"], engines.EngineBenchConfig, "--nproc", "--world-size", "3"),
        (["study"], study.StudyConfig, "--nproc", "--world-sizes", "1,2"),
        (["check", "equivalence"], EquivalenceCheckConfig, "--nproc", "--world-size", "3"),
        (["scale"], script_scaling.ScaleConfig, "--engines", "--engine", "dpscale,torch"),
        (["run"], RunConfig, "--nproc", "--nproc-per-node", "2"),
        (["run"], ModuleFlag, "--module", "-m", None),
    ]


@pytest.mark.parametrize("case", range(9))
def test_new_and_old_spellings_give_the_same_config_and_the_old_one_says_so_once(case, capsys):
    command, cls, new, old, value = _vocabulary_cases()[case]
    after = ["train.py"] if command == ["run"] else []

    def parse(*flags: str) -> dict:
        args = build_parser().parse_args([*command, *flags, *after])
        return dataclass_kwargs(args, cls)

    given = [value] if value is not None else []
    new_fields = parse(new, *given)
    assert new_fields and capsys.readouterr().err == ""
    assert parse(old, *given, old, *given) == new_fields  # given twice: said once
    err = capsys.readouterr().err
    if command == ["run"]:  # torchrun's own spellings are not deprecated
        assert err == ""
    else:
        assert err.splitlines() == [f"dpscale {' '.join(command)}: {old} is deprecated; use {new}"]


def test_run_takes_a_module_as_torchrun_does(tmp_path, monkeypatch):
    from dpscale.cli.module import module_file

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "__main__.py").write_text("print('main')\n")
    (tmp_path / "train_mod.py").write_text("print('train')\n")
    monkeypatch.chdir(tmp_path)
    assert module_file("train_mod") == str(tmp_path / "train_mod.py")
    assert module_file("pkg") == str(tmp_path / "pkg" / "__main__.py")
    with pytest.raises(ConfigError, match="-m: no module 'nowhere_at_all'"):
        module_file("nowhere_at_all")


def test_run_passes_the_module_file_and_torchrun_nproc_to_the_launcher(tmp_path, monkeypatch):
    (tmp_path / "train_mod.py").write_text("")
    monkeypatch.chdir(tmp_path)
    seen = {}

    def fake_run_script(script, args, *, nproc, engine, trace=None, trace_dir=None):
        seen.update(script=script, args=args, nproc=nproc, engine=engine)
        assert trace is None and trace_dir is None  # no --trace
        return 0

    monkeypatch.setattr("dpscale.launch.run.run_script", fake_run_script)
    assert main(["run", "--nproc-per-node", "2", "-m", "train_mod", "--lr", "1"]) == 0
    assert seen == {
        "script": str(tmp_path / "train_mod.py"),
        "args": ["--lr", "1"],
        "nproc": 2,
        "engine": "dpscale",
    }
