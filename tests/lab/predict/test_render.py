"""What the prediction report says about its inputs (render.py), without drawing anything."""

from dataclasses import replace

from dpscale.lab.predict.cluster import INTER, INTRA, Cluster, Link
from dpscale.lab.predict.degrade import ScaleTerms
from dpscale.lab.predict.model import PredictConfig
from dpscale.lab.predict.render import _input_text


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


def test_throughput_reads_as_a_plain_number_from_one_worker_to_a_thousand():
    from dpscale.lab.predict.cluster import preset_cluster
    from dpscale.lab.predict.model import predict
    from dpscale.lab.predict.profile import explicit
    from dpscale.lab.predict.render import format_table

    prof = explicit(
        params=25_600_000, bytes_per_param=4, step_compute_ms=100, backward_fraction=0.5, per_worker_batch=256
    )
    table = format_table(predict(prof, preset_cluster("dgx-a100"), PredictConfig(world_sizes=[1, 1024])))
    assert "e+" not in table, table  # 2.56e+06 samples/s read as a typo next to 2560
    one, many = (line.split() for line in table.splitlines()[1:])
    assert one[6] == "2,560" and many[6].replace(",", "").isdigit() and len(many[6]) > 8, table
