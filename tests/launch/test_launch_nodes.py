"""`dpscale scale` across hosts: the torchrun flags each host gets and the checks on the multi-host flags."""

import pytest

from dpscale.errors import ConfigError
from dpscale.lab.bench.script_scaling import ScaleConfig
from dpscale.launch.hosts import torchrun_node_args
from dpscale.launch.nodes import Nodes

MULTI = {"nnodes": 2, "rdzv_endpoint": "10.0.0.1:29400", "rdzv_id": "job"}


def test_each_host_gets_torchruns_multi_node_flags_and_only_what_the_user_named():
    dynamic = Nodes(
        min_nodes=2, max_nodes=2, rdzv_endpoint="10.0.0.1:29400", rdzv_id="j", local_addr="10.0.0.2"
    )
    args = torchrun_node_args(dynamic)
    assert args[:4] == [
        "--nnodes=2:2",
        "--rdzv-endpoint=10.0.0.1:29400",
        "--rdzv-id=j",
        "--local-addr=10.0.0.2",
    ]
    # 10.0.0.1 is not this machine's: it does not serve the store, whatever its host name says;
    # a rejoin after a failure waits the collective timeout (60 s) + 20 s, not torch's 600 s
    assert "--rdzv-backend=dpscale-c10d" in args
    assert "--rdzv-conf=is_host=0,read_timeout=60,rejoin_timeout=80" in args
    static = Nodes(min_nodes=2, max_nodes=2, rdzv_endpoint="10.0.0.1:29400", rdzv_id="j", node_rank=1)
    assert torchrun_node_args(static)[-2:] == ["--rdzv-backend=static", "--node-rank=1"]


def test_scale_config_takes_the_multi_host_flags():
    config = ScaleConfig(script="train.py", world_sizes=[1, 2, 4], **MULTI)
    assert config.nodes().max_nodes == 2 and ScaleConfig(script="train.py").nodes() is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({**MULTI, "world_sizes": [1, 3]}, "--nproc: world sizes [3] do not split evenly over --nnodes 2"),
        ({"nnodes": 2, "rdzv_id": "job"}, "--nnodes needs --rdzv-endpoint HOST:PORT"),
        ({"rdzv_id": "job"}, "need --nnodes"),
        ({**MULTI, "node_rank": 2}, "--node-rank must be 0..1"),
    ],
)
def test_scale_config_names_the_flag_to_change(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ScaleConfig(script="train.py", **kwargs)
