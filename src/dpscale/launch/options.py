"""`LaunchOptions`: `dpscale train`'s flags beside TrainConfig's, for the launcher rather than the loop.

How many workers on this host (`--nproc N` or `MIN:MAX`), how often to restart them, their threads,
and, across hosts, torchrun's multi-node flags (`--nnodes`, `--rdzv-*`, `--local-addr`; nodes.py).
They say where and how the workers run, not what they train, so they are not TrainConfig fields
and are not saved with it. `--config FILE.toml` sets TrainConfig fields from a file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dpscale.cores import over_host_cap
from dpscale.errors import ConfigError
from dpscale.flags import flag_spec
from dpscale.launch.nodes import Nodes, nodes_from_flags, parse_min_max


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """The launcher's flags of `dpscale train`; checked here, so bad input fails before a worker starts."""

    config: str | None = field(default=None, metadata=flag_spec(metavar="FILE.toml"))
    """set the training fields (--workload and every flag after it) from a TOML file (keys as the
    flags, without --); flags override"""
    nproc: str = "1"
    """workers on this host: N, or MIN:MAX to go on with fewer workers (down to MIN) when the
    restarts at MAX are used up (default 1)"""
    max_restarts: int = 0
    """restart all workers up to this many times after a failure (resuming from checkpoints)"""
    threads: int | None = None
    """intra-op threads per worker (default: cores / nproc)"""
    # across hosts: torchrun's flags and meanings (nodes.py); the same command on every host
    nnodes: str | None = None
    """hosts: N, or MIN:MAX (as torchrun); starts a multi-host job"""
    rdzv_endpoint: str | None = None
    """HOST:PORT of the rendezvous store (multi-host)"""
    rdzv_id: str | None = None
    """the job's name, the same on every host (multi-host)"""
    local_addr: str | None = None
    """the address other hosts reach this one at"""
    rdzv_conf: str | None = None
    """k=v,... passed to torch's rendezvous (e.g. is_host=1, join_timeout=600); rejoin_timeout=S:
    how long the hosts wait for each other after a failure (default: collective timeout + 20 s)"""
    node_rank: int | None = None
    """this host's rank 0..N-1 for a static rendezvous (torchrun's meaning; needs --nnodes N; the
    host of rank 0 serves the store; no restarts across hosts). Default: the rendezvous numbers the hosts"""

    def __post_init__(self) -> None:
        self.nproc_range  # noqa: B018 -- parsing checks --nproc
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1 (intra-op threads per worker), got {self.threads}")
        for what, value in (("--threads", self.threads or 0), ("--nproc", self.nproc_range[1])):
            if refusal := over_host_cap(what, value):
                raise ConfigError(refusal)

    @property
    def nproc_range(self) -> tuple[int, int]:
        """(fewest, most) workers on this host."""
        return parse_min_max("--nproc", self.nproc)

    def nodes(self) -> Nodes | None:
        """The multi-host flags as a Nodes config, or None for a job on this host."""
        return nodes_from_flags(
            nnodes=self.nnodes,
            rdzv_endpoint=self.rdzv_endpoint,
            rdzv_id=self.rdzv_id,
            local_addr=self.local_addr,
            rdzv_conf=self.rdzv_conf,
            node_rank=self.node_rank,
        )
