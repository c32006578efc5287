"""What `dpscale run` and `dpscale scale` check in a user's script, each finding one line with the fix.

Each rank keeps `ScriptFacts` while the script runs (run_child.py feeds them): how many training
forwards of its DDP model synchronize gradients and whether any ran under `no_sync()` or with
`require_backward_grad_sync` off, its optimizer steps and the learning rate each used, the
BatchNorm layers that normalise over the rank's own share of the batch, the parameters the engine
found without a gradient, and, on a job across hosts, where its process group's traffic goes. A
rank writes them as facts-rank<r>.json (a record: the launcher never reads a rank's error text);
`findings` renders one run's. `dpscale scale` also compares the learning rate across world sizes
(lab/bench/script_diagnosis.py), which one run cannot.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dpscale.comm.attempt import interface_toward, source_address
from dpscale.log import get_logger

logger = get_logger(__name__)

FACTS_GLOB = "facts-rank*.json"
MAX_LRS = 64  # learning rates kept per rank: scale compares the first optimizer steps at each N
# synced backwards per optimizer step at or above which accumulation is assumed (2 micro-steps and up)
ACCUMULATING = 1.5


@dataclass
class ScriptFacts:
    """What one rank saw of the script (JSON: `asdict`)."""

    rank: int = 0
    world_size: int = 1
    synced_forwards: int = 0  # training forwards of a DDP model with gradient sync on
    unsynced_forwards: int = 0  # ... under no_sync() or require_backward_grad_sync = False
    optimizer_steps: int = 0
    # synced training forwards between consecutive optimizer steps, for the first MAX_LRS steps
    synced_per_step: list[int] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)  # param_groups[0]["lr"] at each optimizer step
    batch_norm: list[str] = field(default_factory=list)  # BatchNorm layers training per rank (N > 1)
    unused: list[str] = field(default_factory=list)  # parameters the engine found without a gradient
    interface: str | None = None  # the process group's interface problem, in words
    _since_step: int = field(default=0, repr=False)  # synced forwards since the last optimizer step

    @classmethod
    def from_env(cls) -> ScriptFacts:
        return cls(rank=int(os.environ.get("RANK", "0")), world_size=int(os.environ.get("WORLD_SIZE", "1")))

    def on_training_forward(self, module: Any, synced: bool) -> None:
        if synced:
            self.synced_forwards += 1
            self._since_step += 1
        else:
            self.unsynced_forwards += 1
        if self.synced_forwards + self.unsynced_forwards == 1 and self.world_size > 1:
            self.batch_norm = per_rank_batch_norms(module)

    def on_optimizer_step(self, optimizer: Any) -> None:
        self.optimizer_steps += 1
        if len(self.synced_per_step) < MAX_LRS and self.synced_forwards:
            self.synced_per_step.append(self._since_step)
        self._since_step = 0
        if len(self.lrs) < MAX_LRS and optimizer.param_groups:
            lr = optimizer.param_groups[0].get("lr")
            if isinstance(lr, (int, float)) or hasattr(lr, "item"):
                self.lrs.append(float(lr))

    def write(self, directory: str | Path) -> None:
        path = Path(directory) / f"facts-rank{self.rank}.json"
        tmp = path.with_suffix(".tmp")
        doc = asdict(self)
        doc.pop("_since_step")
        tmp.write_text(json.dumps(doc))
        tmp.replace(path)


def read_facts(directory: str | Path) -> list[dict]:
    """The facts every rank of this host wrote in `directory`, by rank."""
    docs = [json.loads(p.read_text()) for p in Path(directory).glob(FACTS_GLOB)]
    return sorted(docs, key=lambda d: d["rank"])


def per_rank_batch_norms(module: Any) -> list[str]:
    """BatchNorm layers in training mode that are not SyncBatchNorm: each normalises over its rank's
    share of the batch, so N workers do not compute what one worker on the whole batch would."""
    from torch import nn

    return [
        name or type(m).__name__
        for name, m in module.named_modules()
        # SyncBatchNorm derives from none of these: it normalises over every rank's samples
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)) and m.training
    ]


def synced_per_optimizer_step(facts: dict) -> float | None:
    """The median synced training forwards per optimizer step where no forward skipped the sync,
    else None."""
    if facts["unsynced_forwards"] or not facts.get("synced_per_step"):
        return None
    return float(statistics.median(facts["synced_per_step"]))


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def findings(facts: list[dict]) -> list[str]:
    """One line per problem in one run's facts (all ranks of this host), with what to change."""
    if not facts:
        return []
    first, lines = facts[0], []
    per_step = synced_per_optimizer_step(first)
    if first["world_size"] > 1 and per_step is not None and per_step >= ACCUMULATING:
        lines.append(
            f"all-reduce on every micro-step: {per_step:.3g} synced backwards per optimizer step, and "
            "neither no_sync() nor require_backward_grad_sync is used: run every micro-step but the last "
            "under `with model.no_sync():` (one all-reduce per optimizer step, the same gradients)"
        )
    if norms := next((f["batch_norm"] for f in facts if f["batch_norm"]), None):
        lines.append(
            f"BatchNorm without SyncBatchNorm ({_names(norms)}): each rank normalises over its own share of "
            "the batch, so N workers are not one big batch (`dpscale check equivalence` would say not "
            "equivalent): convert with torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) before wrapping "
            "(GPU only), or use GroupNorm/LayerNorm, or keep each rank's batch large"
        )
    if unused := next((f["unused"] for f in facts if f["unused"]), None):
        lines.append(
            f"parameters without a gradient in a synchronized backward ({_names(unused)}) while "
            "find_unused_parameters=False: pass find_unused_parameters=True to DistributedDataParallel if "
            "they are unused on purpose, else remove them from the model or set requires_grad=False"
        )
    lines += sorted({f["interface"] for f in facts if f["interface"]})
    return lines


def interface_problem(backend: str, env: dict[str, str] | None = None) -> str | None:
    """Where a job across hosts sends `backend`'s traffic through another interface than the one the
    rendezvous reached the store by (or loopback): the line to say so, else None."""
    env = dict(os.environ) if env is None else env
    master = env.get("MASTER_ADDR")
    if not master or int(env.get("WORLD_SIZE", "1")) <= int(
        env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1"))
    ):
        return None  # one host: loopback is right
    try:
        if ipaddress.ip_address(socket.gethostbyname(master)).is_loopback:
            return None
    except (OSError, ValueError):
        return None
    toward, source = interface_toward(master), source_address(master)
    if toward is None:
        return None
    bound = _bound(backend, env, toward)
    if bound is None or bound in (toward, source):
        return None
    var = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    return (
        f"{backend} would use {bound} while the rendezvous reached {master} through {toward} ({source}): "
        f"its traffic between hosts goes nowhere or the slow way; set {var}={toward}"
    )


def _bound(backend: str, env: dict[str, str], toward: str) -> str | None:
    """The interface (or address) `backend` binds to on this host, as far as the environment says;
    None for NCCL where it may use `toward`."""
    if backend == "nccl":
        named = env.get("NCCL_SOCKET_IFNAME", "")
        # NCCL leaves out loopback unless told; a prefix list names the interfaces it may use
        wanted = [n for n in named.lstrip("=").split(",") if n and not n.startswith("^")]
        return wanted[0] if wanted and not any(toward.startswith(n) for n in wanted) else None
    if backend != "gloo":
        return None
    if gloo_named := env.get("GLOO_SOCKET_IFNAME"):
        return gloo_named.split(",")[0]
    try:  # gloo binds to the address the host name resolves to
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None


def say_now(line: str) -> None:
    """A finding that cannot wait for the run's end (the job may hang right after it)."""
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        logger.warning(line)
