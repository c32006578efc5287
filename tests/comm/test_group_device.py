"""Where a group's collectives need their tensors, and that every metadata collective asks.

A group registered for CUDA only ("cuda:gloo") refuses CPU tensors exactly as NCCL does ("No
backend type associated with device type cpu"): on a CPU-only host it stands in for NCCL. There
the metadata collectives must ask for a CUDA tensor (and so fail on "CUDA", not on the CPU
backend); on a GPU they would run.
"""

import ast
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dpscale.comm.group_device import backend_devices, collective_device, on_collective_device
from dpscale.lab.multirank import run_ranks

SRC = Path(__file__).resolve().parents[2] / "src" / "dpscale"


@pytest.fixture
def cuda_only_world_of_one():
    dist.init_process_group("cuda:gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_gloo_group_takes_cpu_tensors():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert collective_device(None) == torch.device("cpu")
        t = torch.ones(2)
        assert on_collective_device(t, None) is t  # no copy where none is needed
    finally:
        dist.destroy_process_group()


def test_a_group_without_a_cpu_backend_takes_gpu_tensors(cuda_only_world_of_one):
    assert backend_devices(None) == {"cuda": "gloo"}
    assert collective_device(None).type == "cuda"
    # gloo beside it (as in "cpu:gloo,cuda:nccl"): small metadata stays on the CPU
    assert collective_device(dist.new_group(backend="cpu:gloo,cuda:gloo")) == torch.device("cpu")


class _NamedGroup:
    """A group built by hand (never registered) answers for its backend by name."""

    def __init__(self, name: str):
        self._name = name

    def name(self) -> str:
        return self._name


@pytest.mark.parametrize(("name", "device"), [("nccl", "cuda"), ("gloo", "cpu"), ("undefined", "cpu")])
def test_a_hand_made_group_is_judged_by_its_name(name, device):
    assert collective_device(_NamedGroup(name)).type == device


def test_sparse_gradients_on_a_group_without_a_cpu_backend_are_refused_at_construction(
    cuda_only_world_of_one,
):
    from dpscale import DistributedDataParallel

    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    with pytest.raises(ValueError, match=r"^sparse gradients .* cannot be reduced by gloo") as info:
        DistributedDataParallel(model)
    assert "\n" not in str(info.value)


def _metadata_on_a_cuda_only_group(rank: int, world_size: int, store_dir: str) -> dict[str, str]:
    from dpscale.engine.collective_log import CollectiveLog
    from dpscale.engine.compat.model_check import check_same_model
    from dpscale.train.drift import check_replicas

    dist.init_process_group(
        "cuda:gloo", store=dist.FileStore(store_dir + "/store", world_size), rank=rank, world_size=world_size
    )
    outcomes = {"device": str(collective_device(None))}
    log = CollectiveLog()
    log.verify = True

    def attempt(name, fn):
        try:
            fn()
            outcomes[name] = "ok"
        except (RuntimeError, AssertionError) as e:  # AssertionError: torch built without CUDA
            outcomes[name] = str(e).splitlines()[0]

    model = nn.Linear(3, 2)
    attempt("cpu all_reduce", lambda: dist.all_reduce(torch.zeros(1)))
    attempt("check_same_model", lambda: check_same_model(model, None))
    attempt("drift check", lambda: check_replicas(model, step=100))
    attempt("verified object record", lambda: log.record("all_gather_object", "checkpoint outcome"))
    dist.destroy_process_group()
    return outcomes


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU these collectives run for real (gpu-check)")
def test_metadata_collectives_ask_a_cuda_only_group_for_gpu_tensors():
    with tempfile.TemporaryDirectory(prefix="dpscale-cuda-only-") as store_dir:
        outcomes = run_ranks(_metadata_on_a_cuda_only_group, 2, store_dir, backend=None, timeout_s=60)
    for rank_outcomes in outcomes:
        # the stand-in refuses CPU tensors as NCCL does ...
        assert "No backend type associated with device type cpu" in rank_outcomes.pop("cpu all_reduce")
        assert rank_outcomes.pop("device") == "cuda"
        # ... and each metadata collective asked for a GPU tensor instead (none here)
        for what, outcome in rank_outcomes.items():
            assert "CUDA" in outcome and "device type cpu" not in outcome, (what, outcome)


# Collectives that move model data (gradients, parameters, compressed buckets) on the tensors' own
# device; any other collective moves metadata and must build or stage it on collective_device.
DATA_COLLECTIVES = {
    "engine/hooks.py",  # comm hooks reduce the bucket where it lives
    "engine/powersgd.py",  # PowerSGD's factors live beside the bucket
    "engine/reducer.py:_reduce_sparse",  # a sparse gradient (refused on GPU-only groups)
    "engine/compat/model_check.py:broadcast_coalesced",  # parameters and buffers
    "optim/sharded.py:__init__",  # the flat parameters
}
_COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "broadcast",
    "reduce_scatter_tensor",
    "reduce",
    "gather",
    "scatter",
    "all_to_all_single",
    "allreduce",
    "allgather",
}
_ASKS = {"collective_device", "on_collective_device"}


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def _tensor_collectives(tree: ast.AST):
    """(function, line) of each tensor collective: torch.distributed's, a ProcessGroup's own
    (`group.allreduce`), comm.base's `all_gather_into`; object collectives (torch stages those on
    the group's device itself) and a transport's methods (data) are not counted."""
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for call in ast.walk(fn):
            if not isinstance(call, ast.Call):
                continue
            func = call.func
            if isinstance(func, ast.Name) and func.id == "all_gather_into":
                yield fn, call.lineno
            elif isinstance(func, ast.Attribute) and func.attr in _COLLECTIVES:
                by_dist = isinstance(func.value, ast.Name) and func.value.id == "dist"
                if by_dist or func.attr in {"allreduce", "allgather"}:
                    yield fn, call.lineno


def test_every_metadata_collective_builds_its_tensor_where_the_group_needs_it():
    # comm/ holds the transports (data on the caller's device); lab/'s ranks run on the harness's
    # gloo group, and its benches time their own groups
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith(("comm/", "lab/")) or rel in DATA_COLLECTIVES:
            continue
        tree = ast.parse(path.read_text())
        for fn, line in _tensor_collectives(tree):
            if f"{rel}:{fn.name}" in DATA_COLLECTIVES or _names(fn) & _ASKS:
                continue
            offenders.append(f"{rel}:{line} in {fn.name}")
    assert not offenders, (
        "collectives of metadata built without comm.group_device (NCCL takes no CPU tensor): "
        + ", ".join(offenders)
    )


def test_the_metadata_check_sees_a_collective_that_does_not_ask():
    bad = ast.parse("def f(g):\n    t = torch.zeros(1)\n    dist.all_reduce(t, group=g)\n")
    good = ast.parse(
        "def f(g):\n    t = torch.zeros(1, device=collective_device(g))\n    dist.all_reduce(t, group=g)\n"
    )
    assert [fn.name for fn, _ in _tensor_collectives(bad) if not _names(fn) & _ASKS] == ["f"]
    assert [fn.name for fn, _ in _tensor_collectives(good) if not _names(fn) & _ASKS] == []


def test_the_data_collectives_listed_still_exist():
    for entry in DATA_COLLECTIVES:
        rel, _, name = entry.partition(":")
        text = (SRC / rel).read_text()
        assert not name or f"def {name}(" in text, entry
