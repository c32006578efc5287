"""Runs torch's own distributed_test.py (it ships in the torch wheel) under pytest, one process per rank.

A stand-in for pytorch's test/distributed/test_distributed_spawn.py, which is not in the wheel:
the same mix of torch's `TestDistBackend` (the rendezvous through INIT_METHOD / TEMP_DIR) and
`DistributedTest._DistTestBase` (the tests), each test forking WORLD_SIZE ranks. With this folder
first on PYTHONPATH, sitecustomize.py puts dpscale's DistributedDataParallel in place of torch's in
every one of those processes. tests/compat/test_torch_ddp_suite.py runs it; docs/torch-ddp-tests.md
says which tests count and why.
"""

import os

import torch
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

for name in ("BACKEND", "WORLD_SIZE", "TEMP_DIR", "INIT_METHOD"):
    if name not in os.environ:
        raise RuntimeError(f"set {name} (docs/torch-ddp-tests.md has the command)")


class TorchDDPTests(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        # Forked, not spawned: each rank starts with torch, its test utilities and the swap already
        # imported (torch's old test_distributed_fork.py did the same), which more than halves the
        # 11 tests' time (94 s against 218 s at load 5). DPSCALE_DDP_START=spawn runs torch's way.
        if os.environ.get("DPSCALE_DDP_START") == "spawn":
            self._spawn_processes()
        else:
            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()


if __name__ == "__main__":
    run_tests()
