"""`dpscale scale`'s figures from the ranks' step telemetry (the runs themselves: tests/run)."""

from dpscale.lab.bench import script_scaling
from dpscale.lab.bench.script_scaling import ScaleConfig


def _ranks(step_ms: list[float], samples: int) -> list[dict]:
    return [
        {
            "transport": "gloo",
            "host": "h",
            "records": [{"step_ms": t, "samples": samples, "exposed_comm_ms": None} for t in step_ms],
        }
    ]


def test_throughput_and_step_time_come_from_the_same_steps():
    # one step of five held up 20x by the host: the median step says 1 ms, so must samples/s;
    # the mean said 4.8 ms, halved the baseline's throughput and showed 205% efficiency at N=2
    config = ScaleConfig(script="train.py", world_sizes=[1], steps=5, warmup=0, threads_per_worker=1)
    point = script_scaling._point(1, "dpscale", _ranks([1.0, 1.0, 20.0, 1.0, 1.0], samples=8), config)
    assert point.step_ms == 1.0
    assert point.samples_per_s == 8 / 1e-3
