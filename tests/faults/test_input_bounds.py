"""Inputs read from files, and sizes that would exhaust the host (issue #34): each is one line and
exit code 2, before any work; every predict and bench input is bounded so that one call stays
within a stated time, or refused naming the bound.

In process through `dpscale.cli.main.main`, so each refusal is also shown to start nothing.
"""

import json

import pytest

from dpscale.cli.main import main

PREDICT = ["predict", "--step-compute-ms", "100", "--preset", "dgx-a100"]


def _one_line(capsys, argv, words, tmp_path):
    code = main([*argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert words in err[0], err[0]
    return err[0]


@pytest.fixture
def binary(tmp_path):
    path = tmp_path / "binary.dat"
    path.write_bytes(bytes(range(256)) * 4)
    return path


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a refusal got as far as measuring or launching anything."""
    from dpscale.lab.predict import profiling
    from dpscale.launch import launcher

    def forbidden(*args, **kwargs):
        raise AssertionError("work started before the input was checked")

    monkeypatch.setattr(profiling, "measure", forbidden)
    monkeypatch.setattr(launcher, "launch", forbidden)


def test_a_binary_config_file_is_one_line(tmp_path, capsys, binary, no_work):
    _one_line(capsys, ["train", "--config", str(binary)], "is not a TOML file (not UTF-8 text)", tmp_path)


@pytest.mark.parametrize(
    "toml, words",
    [
        ("max_steps = [5]", "sets 'max_steps' to [5], a list; it takes a int"),
        ("lr = true", "sets 'lr' to True, a bool; it takes a float"),
        ("workload = 3", "sets 'workload' to 3, a int; it takes a str"),
        ('max_steps = "five"', "sets 'max_steps' to 'five': invalid literal for int()"),
        ("resume = 1", "sets 'resume' to 1, a int; it takes a bool"),
    ],
)
def test_a_wrongly_typed_config_value_names_the_key(tmp_path, capsys, no_work, toml, words):
    path = tmp_path / "run.toml"
    path.write_text(toml + "\n")
    _one_line(capsys, ["train", "--config", str(path)], words, tmp_path)


def test_a_config_number_given_as_text_is_read_as_the_flag_would(tmp_path):
    from dpscale.flags import config_file_kwargs
    from dpscale.train.config import TrainConfig

    path = tmp_path / "run.toml"
    path.write_text('max_steps = "5"\nlr = "0.5"\n')
    assert config_file_kwargs(str(path), TrainConfig) == {"max_steps": 5, "lr": 0.5}


def test_predict_on_a_binary_profile_is_one_line(tmp_path, capsys, binary):
    argv = ["predict", "--profile", str(binary), "--preset", "dgx-a100", "--report-dir", str(tmp_path)]
    _one_line(capsys, argv, "is not a profile (not UTF-8 text)", tmp_path)


@pytest.mark.parametrize(
    "content",
    [
        json.dumps({"gradient_noise_scale": "big", "steps": 10, "global_batch": 64}),
        json.dumps({"gradient_noise_scale": 100.0, "steps": "ten", "global_batch": 64}),
        "\n".join(json.dumps({"step": i, "gns": "x"}) for i in range(3)),
        json.dumps([1, 2]),
    ],
)
def test_a_noise_scale_file_with_strings_is_one_line(tmp_path, capsys, content, no_work):
    path = tmp_path / "run.json"
    path.write_text(content + "\n")
    argv = [
        *PREDICT,
        "--params",
        "1e6",
        "--goodput",
        "--noise-scale",
        str(path),
        "--report-dir",
        str(tmp_path),
    ]
    _one_line(capsys, argv, f"--noise-scale: cannot read {path}", tmp_path)


@pytest.mark.parametrize("out", ["/proc/dpscale-profile.json", "/sys/dpscale-profile.json"])
def test_profile_out_that_cannot_be_written_is_refused_before_profiling(tmp_path, capsys, no_work, out):
    _one_line(capsys, ["profile", "--model", "mlp", "--out", out], f"--out {out} cannot be written", tmp_path)


def test_profile_out_check_leaves_no_file_behind(tmp_path, monkeypatch):
    from dpscale.paths import check_writable_file

    check_writable_file("--out", tmp_path / "p.json")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--params", "1e300"], "--params: must be between 1 and 1e+13"),
        (["--params", "1e12"], "make 1.53e+05 buckets of --bucket-mb 25"),
        (["--params", "1e8", "--bucket-mb", "0.000001"], "give --bucket-mb"),
        (["--params", "1e8", "--world-sizes", "1000000000"], "at most 1,048,576 workers"),
        (["--params", "1e8", "--world-sizes", ",".join(map(str, range(1, 100)))], "at most 64 world sizes"),
    ],
)
def test_predict_inputs_past_their_bound_are_refused_naming_it(tmp_path, capsys, extra, words):
    _one_line(capsys, [*PREDICT, *extra, "--report-dir", str(tmp_path)], words, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_the_largest_prediction_allowed_is_bounded_in_work():
    """The bound is on work, not time (no timed assertion): buckets x world sizes laid out."""
    from dpscale.lab.predict import profile as profiles
    from dpscale.lab.predict.model import MAX_BUCKET_PREDICTIONS, PredictConfig, check_bounds

    sizes = [1, 2, 4, 8]
    config = PredictConfig(world_sizes=sizes)
    per = MAX_BUCKET_PREDICTIONS // len(sizes)
    fits = profiles.explicit(
        params=per * 25 * 2**20 // 4,
        bytes_per_param=4,
        step_compute_ms=10,
        backward_fraction=0.5,
        per_worker_batch=8,
    )
    check_bounds(fits, config)
    assert len(fits.buckets(config.bucket_mb)) * len(sizes) <= MAX_BUCKET_PREDICTIONS + len(sizes)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["bench", "allreduce", "--iters", "1000000000000"], "--iters: must be between 1 and 10,000"),
        (["bench", "allreduce", "--sizes", "2G"], "more than the 1 GiB a message may be"),
    ],
)
def test_bench_inputs_past_their_bound_are_refused(tmp_path, capsys, argv, words):
    _one_line(capsys, [*argv, "--report-dir", str(tmp_path)], words, tmp_path)


@pytest.mark.parametrize("threads", ["0", "100000"])
def test_scale_threads_per_worker_is_bounded(tmp_path, capsys, threads):
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    argv = ["scale", "--threads-per-worker", threads, "--report-dir", str(tmp_path / "r"), str(script)]
    _one_line(capsys, argv, "--threads-per-worker must be between 1 and", tmp_path)
