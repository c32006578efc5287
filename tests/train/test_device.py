"""Which GPU a worker takes and what the process group is told about it (train/device.py),
with torch.cuda's answers faked: no GPU is needed."""

import pytest
import torch

from dpscale.errors import ConfigError
from dpscale.train.device import check_gpu_count, device_id_for, resolve_device


@pytest.fixture
def gpus(monkeypatch):
    def visible(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    return visible


def test_a_worker_that_sees_one_gpu_takes_it_whatever_its_local_rank(gpus, monkeypatch):
    # SLURM's --gpus-per-task=1 or a per-rank CUDA_VISIBLE_DEVICES: local rank 3 sees only GPU 0
    gpus(1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device("cuda") == torch.device("cuda", 0)
    gpus(4)
    assert resolve_device("auto") == torch.device("cuda", 3)
    assert resolve_device("cuda", local_rank=6) == torch.device("cuda", 2)


def test_more_workers_than_gpus_on_a_host_is_refused_before_they_start(gpus):
    gpus(2)
    check_gpu_count("cuda", 2)
    with pytest.raises(ConfigError, match=r"4 workers on this host need 4 GPUs but only 2 are") as info:
        check_gpu_count("auto", 4)
    assert "\n" not in str(info.value)


def test_cpu_workers_need_no_gpu():
    check_gpu_count("cpu", 8)
    assert device_id_for(torch.device("cpu")) is None
    assert device_id_for(torch.device("cuda", 1)) == torch.device("cuda", 1)
