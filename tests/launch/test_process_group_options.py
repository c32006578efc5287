"""What a worker (and the in-process launcher) tells init_process_group: the collective timeout
always, the GPU (`device_id`) on CUDA. torch.cuda and init_process_group are faked: no GPU needed."""

import datetime

import pytest
import torch
import torch.distributed as dist

from dpscale.launch import launcher, worker
from dpscale.train.config import TrainConfig


class _Started(Exception):
    pass


@pytest.fixture
def init_calls(monkeypatch):
    calls = []

    def init_process_group(backend, **kwargs):
        calls.append((backend, kwargs))
        raise _Started  # nothing past the start is under test

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the in-process run stops early
    return calls


@pytest.mark.parametrize("device", [torch.device("cuda", 1), torch.device("cpu")])
def test_a_worker_binds_its_gpu_to_the_group(init_calls, monkeypatch, device):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(_Started):
        worker._init_process_group(datetime.timedelta(seconds=42), device)
    (backend, kwargs) = init_calls[0]
    assert backend == ("nccl" if device.type == "cuda" else "gloo")
    assert kwargs["timeout"] == datetime.timedelta(seconds=42)
    assert kwargs["device_id"] == (device if device.type == "cuda" else None)


def test_the_in_process_run_gets_the_collective_timeout_and_its_gpu(init_calls, monkeypatch):
    monkeypatch.setattr(launcher, "resolve_device", lambda name, local_rank=None: torch.device("cuda", 0))
    cfg = TrainConfig.from_flat(collective_timeout_s=17)
    with pytest.raises(_Started):
        launcher._run_in_process(cfg, threads=1)
    (backend, kwargs) = init_calls[0]
    assert backend == "nccl" and kwargs["device_id"] == torch.device("cuda", 0)
    assert kwargs["timeout"] == datetime.timedelta(seconds=17)
