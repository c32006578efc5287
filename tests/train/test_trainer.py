"""The training loop: batch splitting, loss normalization, lockstep skips, exact resume, metrics."""

import json

import pytest
import torch
from torch import nn

from dpscale.data import GlobalBatchSampler
from dpscale.lab.multirank import run_ranks
from dpscale.testing.faults import FaultInjector
from dpscale.train.config import TrainConfig
from dpscale.train.trainer import Trainer, param_sha256
from dpscale.workloads import WORKLOADS, Workload
from dpscale.workloads.builtin import _ce
from dpscale.workloads.datasets import TensorData


def _tiny_data(seed):
    g = torch.Generator().manual_seed(7)
    return TensorData(torch.randn(10, 5, generator=g), torch.randint(0, 3, (10,), generator=g)), None


def _tiny_model():
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def register_tiny():
    WORKLOADS["tiny"] = Workload("tiny", _tiny_model, _tiny_data, _ce, global_batch=8, lr=1.0, epochs=1)


def fit_tiny(rank, world, cfg):
    register_tiny()
    trainer = Trainer(TrainConfig.from_flat(**cfg))
    trainer.fit()
    return {n: p.detach().clone() for n, p in trainer.model.module.named_parameters()}


@pytest.mark.slow
def test_accumulated_gradient_equals_full_batch_gradient_with_short_last_batch():
    """10 samples, G=8, W=2, k=2, tail=keep: step 1 is full, step 2 has 2 samples, so one rank's
    last micro-batch is empty and the other's holds one sample. Plain SGD with lr=1 makes the
    parameter change equal the gradient, compared with the single-process full-batch mean."""
    cfg = dict(
        workload="tiny",
        global_batch=8,
        accumulation_steps=2,
        tail="keep",
        epochs=1,
        optimizer="sgd",
        lr=1.0,
        momentum=0.0,
        progress="none",
        seed=3,
    )
    got = run_ranks(fit_tiny, 2, cfg)
    register_tiny()
    torch.manual_seed(3)
    ref = _tiny_model()
    data, _ = _tiny_data(3)
    sampler = GlobalBatchSampler(10, global_batch=8, world_size=1, rank=0, seed=3, tail="keep")
    opt = torch.optim.SGD(ref.parameters(), lr=1.0)
    for step in sampler.iter_steps():
        (idx,) = step.micro_batches
        assert len(idx) == step.global_count
        x, y = data.batch(idx)
        opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    for n, p in ref.named_parameters():
        for rank_params in got:
            torch.testing.assert_close(rank_params[n], p.detach(), rtol=1e-5, atol=1e-6, msg=n)


def fit_digits(rank, world, cfg):
    trainer = Trainer(TrainConfig.from_flat(**cfg))
    result = trainer.fit()
    return result.to_dict(), {n: p.detach().clone() for n, p in trainer.model.module.named_parameters()}


@pytest.mark.slow
def test_world1_with_2_accumulation_steps_equals_world2():
    base = dict(workload="digits", global_batch=64, max_steps=20, progress="none")
    ((r1, p1),) = run_ranks(fit_digits, 1, {**base, "accumulation_steps": 2})
    (r2, p2), _ = run_ranks(fit_digits, 2, base)
    assert (r1["micro_batch"], r1["accumulation_steps"]) == (32, 2)
    assert (r2["micro_batch"], r2["accumulation_steps"]) == (32, 1)
    for n in p1:
        torch.testing.assert_close(p1[n], p2[n], rtol=1e-5, atol=1e-5, msg=n)


@pytest.mark.slow
def test_resume_is_bit_exact(tmp_path):
    base = dict(
        workload="digits",
        global_batch=64,
        progress="none",
        checkpoint_every=10,
        optimizer="adamw",
        lr=1e-3,
        warmup_steps=5,
    )
    (full, _), _ = run_ranks(fit_digits, 2, {**base, "max_steps": 20, "checkpoint_dir": str(tmp_path / "a")})
    ckpt = str(tmp_path / "b")
    (half, _), _ = run_ranks(fit_digits, 2, {**base, "max_steps": 10, "checkpoint_dir": ckpt})
    assert half["steps"] == 10 and half["checkpoint"].endswith("step-00000010")
    (resumed, _), _ = run_ranks(
        fit_digits, 2, {**base, "max_steps": 20, "checkpoint_dir": ckpt, "resume": True}
    )
    assert resumed["resumed_from_step"] == 10 and resumed["steps"] == 20
    assert resumed["param_sha256"] == full["param_sha256"]
    assert resumed["samples_seen"] == full["samples_seen"] == 20 * 64


def _gns_lines(directory):
    return [json.loads(line)["gns"] for line in (directory / "metrics.jsonl").read_text().splitlines()]


# The noise-scale estimate continues exactly: its EMAs and run sums are in the checkpoint, and the
# engine measures on the same steps (every 8th: 0, 8, 16) after a resume at step 10 as without one.
@pytest.mark.parametrize(
    ("world", "split"),
    [(2, dict(global_batch=64)), (1, dict(global_batch=64, accumulation_steps=2))],
    ids=["2-workers", "1-worker-accumulation"],
)
@pytest.mark.slow
def test_resume_continues_the_noise_scale_estimate_exactly(world, split, tmp_path):
    base = dict(workload="digits", progress="none", lr=0.05) | split
    full_dir, half_dir = tmp_path / "full", tmp_path / "half"
    (full, _), *_ = run_ranks(fit_digits, world, {**base, "max_steps": 20, "metrics_dir": str(full_dir)})
    half = {
        **base,
        "checkpoint_every": 10,
        "checkpoint_dir": str(tmp_path / "ckpt"),
        "metrics_dir": str(half_dir),
    }
    run_ranks(fit_digits, world, {**half, "max_steps": 10})
    (resumed, _), *_ = run_ranks(fit_digits, world, {**half, "max_steps": 20, "resume": True})
    assert resumed["resumed_from_step"] == 10
    assert full["gradient_noise_scale"] is not None
    assert resumed["gradient_noise_scale"] == full["gradient_noise_scale"]
    assert _gns_lines(half_dir) == _gns_lines(full_dir)  # every step's smoothed figure, bit for bit


def nan_on_one_rank(rank, world, cfg):
    trainer = Trainer(TrainConfig.from_flat(**cfg), callbacks=[FaultInjector()])
    before = {}

    step_fn = trainer._train_step

    def spy(batch):
        if trainer.step == 2:  # about to run step 3
            before.update({n: p.detach().clone() for n, p in trainer.model.module.named_parameters()})
        m = step_fn(batch)
        if trainer.step == 3:
            before["unchanged"] = all(
                torch.equal(before[n], p) for n, p in trainer.model.module.named_parameters()
            )
        return m

    trainer._train_step = spy
    result = trainer.fit()
    return result.to_dict(), before["unchanged"]


@pytest.mark.slow
def test_non_finite_gradient_on_one_rank_makes_every_rank_skip(tmp_path, monkeypatch):
    cfg = dict(workload="digits", max_steps=6, progress="none", metrics_dir=str(tmp_path))
    (r0, same0), (r1, same1) = run_ranks(
        nan_on_one_rank, 2, cfg, env={"DPSCALE_FAULTS": "nan_grad@step=3,rank=1"}
    )
    assert r0["skipped_steps"] == r1["skipped_steps"] == 1
    assert same0 and same1, "a skipped step must leave the parameters untouched"
    assert r0["param_sha256"] == r1["param_sha256"] and r0["steps"] == r1["steps"] == 6
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["skipped"] for m in lines] == [False, False, True, False, False, False]


@pytest.mark.slow
def test_metrics_lines_have_the_documented_fields(tmp_path):
    cfg = dict(workload="digits", max_steps=3, progress="none", metrics_dir=str(tmp_path))
    run_ranks(fit_digits, 2, cfg)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    for key in (
        "samples_seen",
        "loss",
        "lr",
        "grad_norm",
        "step_ms",
        "samples_per_s",
        "comm_ms",
        "exposed_comm_ms",
    ):
        assert all(m[key] is not None for m in lines), key
    assert lines[-1]["samples_seen"] == 3 * 64


def test_param_sha256_is_order_and_bit_sensitive():
    a = nn.Linear(3, 2)
    h = param_sha256(a)
    with torch.no_grad():
        a.bias[0] = torch.nextafter(a.bias[0], torch.tensor(10.0))
    assert param_sha256(a) != h


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(global_batch=0), "global_batch"),
        (dict(micro_batch=4, accumulation_steps=2), "micro_batch and accumulation_steps"),
        (dict(optimizer="lion"), "optimizer"),
        (dict(tail="wrap"), "tail"),
        (dict(lr=-1.0), "lr"),
        (dict(resume=True), "checkpoint_dir"),
        (dict(workload="imagenet"), "workload"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TrainConfig.from_flat(**kwargs)


def test_batch_split_errors_say_what_to_change():
    with pytest.raises(ValueError, match="multiple of 3"):
        TrainConfig.from_flat(global_batch=64).resolve_batch(3)
    with pytest.raises(ValueError, match="at least 128"):
        TrainConfig.from_flat(global_batch=64).resolve_batch(128)
    with pytest.raises(ValueError, match="divisor of 32"):
        TrainConfig.from_flat(global_batch=64, micro_batch=5).resolve_batch(2)
    assert TrainConfig.from_flat(global_batch=64, micro_batch=8).resolve_batch(2) == (8, 4)
