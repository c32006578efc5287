"""fp16 compression's cost on a CPU worker (lab/predict/compression_cost.py) and where the model
puts it: the casts lengthen backward on a CPU cluster, and nothing on a GPU one."""

from dataclasses import replace

import pytest
import torch

from dpscale.lab.predict import compression_cost
from dpscale.lab.predict.cluster import INTER, INTRA, Cluster, Link
from dpscale.lab.predict.compression_cost import CompressionCost
from dpscale.lab.predict.model import CASTS_LABEL, PredictConfig, predict
from dpscale.lab.predict.profile import explicit

MB = 1 << 20
CASTS = CompressionCost(
    cast_in_ms_per_mb=0.2,
    divide_ms_per_mb=0.05,
    stage_ms_per_mb=0.025,
    cast_out_ms_per_mb=0.05,
    add16_ms_per_mb=0.1,
    add32_ms_per_mb=0.06,
)


def test_extra_ms_counts_the_casts_the_staging_and_the_fp16_sums():
    assert CASTS.extra_ms(100 * MB, 1) == 0.0  # one worker reduces nothing
    # casts 0.2 - 0.05 + 0.05, staging 2 x 0.025, sums 1/2 x (0.1 - 0.06 / 2), per MiB
    assert CASTS.extra_ms(100 * MB, 2) == pytest.approx(100 * (0.2 + 0.05 + 0.035))
    assert replace(CASTS, staged=False).extra_ms(100 * MB, 2) == pytest.approx(100 * (0.2 + 0.035))
    assert CASTS.extra_ms(100 * MB, 4) > CASTS.extra_ms(100 * MB, 2)  # each rank adds more parts
    assert CompressionCost.from_dict(CASTS.to_dict()) == CASTS


def test_bad_rates_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="CompressionCost.stage_ms_per_mb: must be >= 0"):
        replace(CASTS, stage_ms_per_mb=-1.0)


def test_measure_times_every_operation_and_restores_the_thread_count():
    before = torch.get_num_threads()
    cost = compression_cost.measure(1, sample_mb=1, rounds=3, staged=False)
    assert torch.get_num_threads() == before and not cost.staged
    rates = {k: v for k, v in cost.to_dict().items() if k != "staged"}
    assert len(rates) == 6 and all(v > 0 for v in rates.values())


def _cluster(gpu: bool) -> Cluster:
    link = Link(name=INTRA, bandwidth_GBps=3.5, latency_us=10.0)
    return Cluster(workers_per_node=2, intra=link, inter=replace(link, name=INTER), gpu=gpu)


def test_the_model_adds_the_casts_to_backward_on_cpu_clusters_only():
    prof = explicit(
        params=25 * MB, bytes_per_param=4, step_compute_ms=100.0, backward_fraction=0.5, per_worker_batch=8
    )
    fp16 = PredictConfig(world_sizes=[2], compression=2.0, contention=1.0)
    (free,) = predict(prof, _cluster(gpu=False), fp16)
    (cast,) = predict(prof, _cluster(gpu=False), replace(fp16, compression_cost=CASTS))
    extra = CASTS.extra_ms(prof.param_bytes, 2)
    assert cast.compute_ms == pytest.approx(free.compute_ms + extra)
    assert cast.losses_ms[CASTS_LABEL] == pytest.approx(extra) and cast.efficiency < free.efficiency
    # uncompressed, or on GPUs (they cast at memory speed), the rates change nothing
    plain = replace(fp16, compression=1.0)
    assert predict(prof, _cluster(gpu=False), replace(plain, compression_cost=CASTS)) == predict(
        prof, _cluster(gpu=False), plain
    )
    (gpu,) = predict(prof, _cluster(gpu=True), replace(fp16, compression_cost=CASTS))
    assert gpu.compute_ms == pytest.approx(free.compute_ms)
