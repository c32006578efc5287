"""What the prediction report says about its inputs (render.py), without drawing anything."""

from dataclasses import replace

from dpscale.predict.cluster import INTER, INTRA, Cluster, Link
from dpscale.predict.degrade import ScaleTerms
from dpscale.predict.model import PredictConfig
from dpscale.predict.render import _input_text


def test_the_report_says_how_the_input_pipeline_was_modelled():
    cluster = Cluster(
        workers_per_node=8,
        intra=Link(name=INTRA, bandwidth_GBps=100.0, latency_us=0.0),
        inter=Link(name=INTER, bandwidth_GBps=1.0, latency_us=0.0),
    )
    config = PredictConfig(world_sizes=[8])
    assert _input_text(cluster, config) == "unlimited"
    assert _input_text(replace(cluster, input_samples_per_s=12000.0), config) == "12,000 samples/s per node"
    given = replace(config, terms=ScaleTerms(input_samples_per_s=900.0), data_workers=4)
    assert _input_text(cluster, given) == "900 samples/s per node"  # a measured rate wins
    assert _input_text(cluster, replace(config, data_workers=0)).startswith(
        "loaded in each worker's own loop"
    )
    assert "x 4 loader process(es)" in _input_text(cluster, replace(config, data_workers=4))
    off = replace(given, terms=ScaleTerms(input_pipeline=False, input_samples_per_s=900.0))
    assert _input_text(cluster, off) == "off"
