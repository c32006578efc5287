"""torch's own DDP tests (distributed_test.py, in the torch wheel) pass on dpscale's engine.

The 11 tests of record (docs/torch-ddp-tests.md): the DDP tests of distributed_test.py that run on
a CPU-only machine with gloo. They run in a child pytest with scripts/torch_ddp_swap first on
PYTHONPATH, so every process builds dpscale's DistributedDataParallel where the test says torch's.
In the compat tier: a new torch release changes these tests with the class they test.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.compat]

ROOT = Path(__file__).resolve().parents[2]
SWAP = ROOT / "scripts" / "torch_ddp_swap"
OF_RECORD = [
    "test_DistributedDataParallelCPU",
    "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad",
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_accumulate_gradients_no_sync_grad_is_view",
    "test_ddp_create_graph",
    "test_ddp_logging_data_cpu",
    "test_grads_same_across_ranks_with_no_sync",
    "test_static_graph_api_cpu",
]


@pytest.mark.timeout(900)  # 11 tests, each forking 2 ranks (spawned: DPSCALE_DDP_START=spawn, slower)
def test_torchs_ddp_tests_pass_on_dpscales_engine(tmp_path):
    pytest.importorskip("expecttest", reason="torch's test utilities need expecttest (the dev extra)")
    (tmp_path / "barrier").touch()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SWAP), str(ROOT / "src")]),
        "BACKEND": "gloo",
        "WORLD_SIZE": "2",
        "TEMP_DIR": str(tmp_path),
        "INIT_METHOD": f"file://{tmp_path}/init",
        "OMP_NUM_THREADS": "1",
        "DPSCALE_SWAP": "1",
    }
    driver = SWAP / "ddp_tests_driver.py"
    ids = [f"{driver}::TorchDDPTests::{name}" for name in OF_RECORD]
    # an empty ini of its own: this project's pytest settings (markers, timeout, pythonpath) are not
    # torch's; -p no:cacheprovider: nothing written beside the driver
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    command = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-c", "pytest.ini"]
    done = subprocess.run(
        [*command, *ids], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=880
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    assert done.returncode == 0 and summary.startswith(f"{len(OF_RECORD)} passed"), done.stdout[-6000:]
    # the swap took: the driver's ranks built dpscale's class (sitecustomize prints nothing, so ask it)
    check = "import torch.nn.parallel as p; print(p.DistributedDataParallel.__module__)"
    seen = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
    assert seen.stdout.strip() == "dpscale.engine.ddp", seen.stderr
