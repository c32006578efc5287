"""Scenario 10: a run stopped mid-epoch resumes with exactly the sample order it would have had.

The sampler's position is counted in global batches, so the resumed run may even use another
world size: here 2 workers stop at step 13 of a 16-step epoch and 1 worker (with 2 accumulation
steps, keeping the micro-batch) finishes. Per step, the samples of the global batch and their
order must equal the uninterrupted run's, so no sample is repeated or skipped across the resume.
"""

import pytest
import torch

from dpscale.lab.multirank import run_ranks
from dpscale.train.config import TrainConfig
from dpscale.train.trainer import Trainer
from support.recording import record_batches

pytestmark = pytest.mark.slow  # starts processes (spawned ranks or the CLI)

# synthetic: 8192 training samples; 512 per global batch gives 16 steps per epoch
BASE = dict(workload="synthetic", global_batch=512, progress="none", seed=5)
TOTAL, STOP = 24, 13


def fit_and_record(rank, world, cfg):
    trainer = Trainer(TrainConfig.from_flat(**cfg))
    seen = record_batches(trainer)
    result = trainer.fit()
    params = {n: p.detach().clone() for n, p in trainer.model.module.named_parameters()}
    return result.to_dict(), seen, params


def global_batches(per_rank):
    """Per step: (epoch, the global batch in order) = the ranks' parts one after the other."""
    steps = zip(*(seen for _, seen, _ in per_rank), strict=True)
    return [(parts[0][0], [i for _, part in parts for i in part]) for parts in steps]


def test_mid_epoch_resume_continues_the_same_sample_order(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    full = run_ranks(fit_and_record, 2, {**BASE, "max_steps": TOTAL}, timeout_s=90)
    first = run_ranks(fit_and_record, 2, {**BASE, "max_steps": STOP, "checkpoint_dir": ckpt}, timeout_s=90)
    rest = run_ranks(
        fit_and_record, 1, {**BASE, "max_steps": TOTAL, "checkpoint_dir": ckpt, "resume": True}, timeout_s=90
    )
    resumed, _, resumed_params = rest[0]
    assert resumed["resumed_from_step"] == STOP and resumed["steps"] == TOTAL
    assert (resumed["world_size"], resumed["micro_batch"], resumed["accumulation_steps"]) == (1, 256, 2)

    expected = global_batches(full)
    got = global_batches(first) + global_batches(rest)
    assert len(got) == TOTAL
    assert got == expected, "the resumed run saw other samples or another order"
    epoch0 = [i for epoch, batch in got if epoch == 0 for i in batch]
    assert sorted(epoch0) == list(range(8192)), "epoch 0 must use every sample exactly once"
    epoch1 = [i for epoch, batch in got if epoch == 1 for i in batch]
    assert len(epoch1) == (TOTAL - 16) * 512 and len(set(epoch1)) == len(epoch1)

    # Same data, same steps; only the floating-point summation order differs (two ranks averaging
    # vs one accumulating), which after 11 SGD steps stays far below these tolerances.
    _, _, full_params = full[0]
    for name, p in full_params.items():
        torch.testing.assert_close(resumed_params[name], p, rtol=1e-4, atol=1e-5, msg=name)
