"""dpscale.Task in the trainer: inputs of every kind, exact data-parallel gradients, evaluation
gathered over ranks, precision, and the contract's one-line refusals."""

import pytest
import torch
import torch.nn.functional as F
import user_tasks

from dpscale import Task, TrainConfig, Trainer
from dpscale.data import GlobalBatchSampler
from dpscale.lab.multirank import run_ranks
from dpscale.testing.faults import FaultInjector
from dpscale.workloads.task import probe

ONE_SGD_STEP = dict(
    global_batch=16, max_steps=1, optimizer="sgd", lr=1.0, momentum=0.0, progress="none", seed=3
)


def fit(rank, world, task_name, cfg):
    trainer = Trainer(TrainConfig.from_flat(**cfg), getattr(user_tasks, task_name)())
    result = trainer.fit()
    return result.to_dict(), {n: p.detach().clone() for n, p in trainer.model.module.named_parameters()}


def _reference_step(task, seed):
    """One full-batch SGD step (lr 1) on the sampler's first global batch, in one process."""
    torch.manual_seed(seed)
    model = task.model()
    (idx,) = next(
        GlobalBatchSampler(
            len(task.train_data), global_batch=16, world_size=1, rank=0, seed=seed
        ).iter_steps()
    ).micro_batches
    x, y = task.collate([task.train_data[i] for i in idx])
    out = model(**x) if isinstance(x, dict) else model(*x)
    F.cross_entropy(out, y).backward()
    return {n: (p - p.grad).detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("task_name", ["dict_task", "tuple_task"])
@pytest.mark.slow
def test_two_workers_with_accumulation_take_the_full_batch_step(task_name):
    """Dict inputs through default_collate, tuple inputs through the task's collate_fn: 2 workers
    x 2 accumulation steps give the single-process full-batch step (fp32 tolerance)."""
    results = run_ranks(fit, 2, task_name, dict(ONE_SGD_STEP, accumulation_steps=2))
    want = _reference_step(getattr(user_tasks, task_name)(), seed=3)
    for _, params in results:
        for n, p in want.items():
            torch.testing.assert_close(params[n], p, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.slow
def test_eval_means_are_over_every_eval_sample_once_whatever_the_world_size():
    """7 eval samples over 2 ranks (4 + 3): the gathered means equal the one-process means."""
    results = run_ranks(fit, 2, "dict_task", ONE_SGD_STEP)
    (r0, params), (r1, _) = results
    assert r0["eval"] == r1["eval"] and set(r0["eval"]) == {"loss", "accuracy"}
    task = user_tasks.dict_task()
    model = task.model()
    model.load_state_dict(params)
    x, y = task.collate([task.eval_data[i] for i in range(len(task.eval_data))])
    with torch.no_grad():
        out = model(**x)
    assert r0["eval"]["loss"] == pytest.approx(float(F.cross_entropy(out, y)), rel=1e-5)
    assert r0["eval"]["accuracy"] == pytest.approx(float(user_tasks.correct(out, y).mean()))
    assert r0["test_accuracy"] == r0["eval"]["accuracy"]


@pytest.mark.slow
def test_task_optimizer_factory_is_used_and_training_learns():
    (r, _), _ = run_ranks(fit, 2, "tensor_task", dict(global_batch=32, epochs=5, progress="none"))
    assert r["eval"]["accuracy"] > 0.9


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.slow
def test_mixed_precision_on_cpu_trains(precision):
    (r, _), _ = run_ranks(
        fit, 2, "tensor_task", dict(global_batch=32, epochs=5, progress="none", precision=precision)
    )
    assert r["skipped_steps"] == 0 and r["eval"]["accuracy"] > 0.9


@pytest.mark.slow
def test_data_workers_give_the_same_run_as_loading_in_process():
    """The DataLoader reads ahead from a copy of the sampler: same batches, same weights."""
    base = dict(global_batch=32, epochs=2, progress="none")
    (plain, _), _ = run_ranks(fit, 2, "tensor_task", base)
    (loaded, _), _ = run_ranks(fit, 2, "tensor_task", dict(base, data_workers=2))
    assert loaded["param_sha256"] == plain["param_sha256"]


@pytest.mark.parametrize(
    "name, message",
    [
        (
            "scalar_loss",
            "returned a scalar; dpscale needs per-sample values to weight samples exactly across "
            'workers: pass reduction="none"',
        ),
        ("bad_metric", "Task.metrics['accuracy'] returned a scalar"),
        ("model_raises", "Task.model() raised RuntimeError: no such layer size"),
        ("model_not_module", "Task.model() returned str; it must return a torch.nn.Module"),
    ],
)
def test_probe_refuses_a_broken_task_in_one_line(name, message):
    with pytest.raises(ValueError) as e:
        probe(getattr(user_tasks, name)())
    assert message in str(e.value) and "\n" not in str(e.value)


def test_task_checks_its_fields():
    data = user_tasks.DictData(4)
    with pytest.raises(ValueError, match="Task.model must be a callable that builds the model"):
        Task(model=user_tasks.TwoInputs(), train_data=data, loss=user_tasks.ce)
    with pytest.raises(ValueError, match="map-style dataset"):
        Task(model=user_tasks.TwoInputs, train_data=iter([1, 2]), loss=user_tasks.ce)
    with pytest.raises(ValueError, match="Task.loss must be a function"):
        Task(model=user_tasks.TwoInputs, train_data=data)
    with pytest.raises(ValueError, match="other than 'loss'"):
        Task(model=user_tasks.TwoInputs, train_data=data, loss=user_tasks.ce, metrics={"loss": user_tasks.ce})


def fit_fp16(rank, world):
    trainer = Trainer(
        TrainConfig.from_flat(global_batch=32, max_steps=4, progress="none", precision="fp16"),
        user_tasks.tensor_task(),
        callbacks=[FaultInjector()],  # DPSCALE_FAULTS below
    )
    result = trainer.fit()
    return result.skipped_steps, trainer.precision.scaler.get_scale(), result.param_sha256


@pytest.mark.slow
def test_fp16_skips_an_overflowed_step_on_every_rank_and_backs_off_the_scale_alike():
    """A non-finite gradient on rank 1 only (after the reduction): both ranks skip step 2 and
    halve the loss scale, so weights and scales stay identical."""
    (skips0, scale0, sha0), (skips1, scale1, sha1) = run_ranks(
        fit_fp16, 2, env={"DPSCALE_FAULTS": "nan_grad@step=2,rank=1"}
    )
    assert skips0 == skips1 == 1 and scale0 == scale1 == 65536.0 / 2 and sha0 == sha1


@pytest.mark.slow
def test_an_fp16_run_resumes_bit_exactly_loss_scale_included(tmp_path):
    """Stopped after 3 steps and resumed to 6 == 6 steps in one go (param_sha256), with one
    overflowed step before the stop, so the resumed run must start from the backed-off scale."""
    fault = {"DPSCALE_FAULTS": "nan_grad@step=2"}
    base = dict(global_batch=32, progress="none", precision="fp16", drift_check_every=0)
    (whole,) = run_ranks(fit_steps, 1, dict(base, max_steps=6), env=fault)
    ckpt = str(tmp_path / "ck")
    run_ranks(fit_steps, 1, dict(base, max_steps=3, checkpoint_dir=ckpt), env=fault)
    (resumed,) = run_ranks(fit_steps, 1, dict(base, max_steps=6, checkpoint_dir=ckpt, resume=True), env=fault)
    assert resumed == whole and whole[1:] == (1, 65536.0 / 2)


def fit_steps(rank, world, cfg):
    trainer = Trainer(TrainConfig.from_flat(**cfg), user_tasks.tensor_task(), callbacks=[FaultInjector()])
    result = trainer.fit()
    return result.param_sha256, result.skipped_steps, trainer.precision.scaler.get_scale()
