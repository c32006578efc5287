"""launch/hosts.py: the lab's multi-host flags, and which host runs which world size."""

import pytest

from dpscale.errors import ConfigError
from dpscale.flags import field_docs
from dpscale.lab.bench.scaling import ScalingConfig
from dpscale.launch.hosts import job_nodes
from dpscale.launch.nodes import Nodes

ELSEWHERE = {"min_nodes": 2, "max_nodes": 2, "rdzv_endpoint": "10.0.0.1:29400", "rdzv_id": "m"}


def test_each_world_size_above_one_is_its_own_job_and_the_baseline_stays_on_the_store_host():
    assert job_nodes(None, 2, "scaling") is None  # one host: as before
    other = Nodes(**ELSEWHERE)  # 10.0.0.1 is not this machine: it does not serve the store
    assert job_nodes(other, 1, "scaling") is False
    assert job_nodes(other, 4, "dpscale").rdzv_id == "m-dpscale-n4"
    store = Nodes(**ELSEWHERE, rdzv_conf={"is_host": "1"})
    assert job_nodes(store, 1, "scaling") is None
    assert job_nodes(Nodes(**ELSEWHERE, node_rank=0), 1, "scaling") is None


def test_bench_scaling_takes_the_host_flags_and_their_help():
    config = ScalingConfig(world_sizes=[1, 2, 4], nnodes=2, rdzv_endpoint="10.0.0.1:29400", rdzv_id="m")
    assert config.nodes().max_nodes == 2
    assert field_docs(ScalingConfig)["nnodes"].startswith("hosts, a fixed number")  # inherited docs
    with pytest.raises(ConfigError, match="--nproc: world sizes \\[3\\] do not split evenly"):
        ScalingConfig(world_sizes=[1, 3], nnodes=2, rdzv_endpoint="10.0.0.1:29400", rdzv_id="m")
