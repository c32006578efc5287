"""`dpscale train` across hosts: torchrun's multi-node flags, and which host serves the store.

`dpscale train --nnodes MIN:MAX --rdzv-endpoint HOST:PORT --rdzv-id ID` on every host starts this
host's workers through torch's elastic agent with the `dpscale-c10d` rendezvous (torch's c10d,
plus the round every host shares; see rendezvous.py). The flags keep torchrun's names and mean
what they mean there. The host whose interfaces carry the endpoint's address serves the
rendezvous store (`is_host`): torch guesses that from the host name, which fails where the name
does not resolve to that address (containers, network namespaces); a bind test does not.
`--rdzv-conf key=value,...` passes through (an explicit `is_host` wins).
"""

from __future__ import annotations

import ipaddress
import math
import socket
from dataclasses import dataclass, field

from dpscale.errors import ConfigError

REJOIN_TIMEOUT = "rejoin_timeout"
"""dpscale's own --rdzv-conf key: seconds a host waits for the others to come back after a
failure (torch's join_timeout then applies only to the first round)."""
REJOIN_MARGIN_S = 20
"""What a live host needs on top of the collective timeout to rejoin: its agent sees the new round
within its monitor interval (0.1 s), stops its workers (up to 5 s) and makes a few store calls."""
_LAST_CALL_S = 30  # torch's last_call_timeout default


@dataclass(kw_only=True)
class Nodes:
    min_nodes: int
    """Fewest hosts the job runs with (`--nnodes MIN:MAX`, or N for both)."""
    max_nodes: int
    """Most hosts the job runs with."""
    rdzv_endpoint: str
    """HOST:PORT of the rendezvous store, the same on every host (`--rdzv-endpoint`)."""
    rdzv_id: str
    """A name for the job, the same on every host (`--rdzv-id`)."""
    local_addr: str | None = None
    """The address other hosts reach this one at (`--local-addr`; default: torch's lookup)."""
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    """Passed to torch's rendezvous (`--rdzv-conf k=v,...`), e.g. join_timeout, is_host."""
    node_rank: int | None = None
    """This host's rank for a static rendezvous (`--node-rank`, torchrun's meaning: 0..N-1, a
    fixed number of hosts, the host of rank 0 serves the store at the endpoint); None: dynamic
    (`dpscale-c10d`), where the rendezvous numbers the hosts."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ConfigError(
                f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got {self.min_nodes}:{self.max_nodes}"
            )
        host, _, port = self.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"--rdzv-endpoint must be HOST:PORT with a port in 1..65535, got {self.rdzv_endpoint!r}"
            )
        if not self.rdzv_id:
            raise ConfigError("--rdzv-id must name the job (the same on every host), got ''")
        if self.node_rank is not None:
            if self.min_nodes != self.max_nodes:
                raise ConfigError(
                    f"--node-rank is for a fixed number of hosts (static rendezvous): give --nnodes N, "
                    f"not {self.min_nodes}:{self.max_nodes}"
                )
            if not 0 <= self.node_rank < self.max_nodes:
                raise ConfigError(
                    f"--node-rank must be 0..{self.max_nodes - 1} for --nnodes {self.max_nodes}, "
                    f"got {self.node_rank}"
                )
        for key in ("read_timeout", "join_timeout", "last_call_timeout", REJOIN_TIMEOUT):
            timeout = self.rdzv_conf.get(key, "1")
            if not timeout.isdigit() or int(timeout) < 1:
                raise ConfigError(
                    f"--rdzv-conf {key} must be a whole number of seconds >= 1, got {timeout!r}"
                )

    @property
    def endpoint_host(self) -> str:
        return self.rdzv_endpoint.rpartition(":")[0].strip("[]")

    def serves_store(self) -> bool:
        """Whether this host serves the rendezvous store: `is_host` from --rdzv-conf, else whether
        one of its interfaces carries the endpoint's address."""
        if self.node_rank is not None:
            return self.node_rank == 0
        if "is_host" in self.rdzv_conf:
            return self.rdzv_conf["is_host"].lower() in ("1", "true", "yes", "y", "t")
        return carries_address(self.endpoint_host)

    def read_timeout_s(self, collective_timeout_s: float) -> int:
        """How long one call to the rendezvous store may take: `read_timeout` from --rdzv-conf, else
        the collective timeout (torch's default, 60 s, would keep a cut-off host's agent waiting
        minutes after its workers gave up: each of its store calls waits that long)."""
        if "read_timeout" in self.rdzv_conf:
            return int(self.rdzv_conf["read_timeout"])
        return max(1, math.ceil(collective_timeout_s))

    def rejoin_timeout_s(self, collective_timeout_s: float) -> int | None:
        """How long a host waits for the others to rejoin after a failure (None: torch's
        join_timeout, 600 s by default, as for the first round).

        `rejoin_timeout` or `join_timeout` from --rdzv-conf wins. Otherwise the collective timeout
        T (a host restarting because of the same fault gets there when its own workers time out)
        plus REJOIN_MARGIN_S, plus torch's last-call wait when the job may run with fewer hosts
        (`--nnodes MIN:MAX`: once MIN hosts are back the round waits that long for more, then goes
        on without the lost ones). Without it a host cut off for good kept the others waiting
        600 s before they failed.
        """
        if REJOIN_TIMEOUT in self.rdzv_conf:
            return int(self.rdzv_conf[REJOIN_TIMEOUT])
        if "join_timeout" in self.rdzv_conf:
            return None
        last_call = int(self.rdzv_conf.get("last_call_timeout", _LAST_CALL_S))
        elastic = last_call if self.min_nodes < self.max_nodes else 0
        return math.ceil(collective_timeout_s) + REJOIN_MARGIN_S + elastic

    def rdzv_configs(self, collective_timeout_s: float = 60.0) -> dict[str, object]:
        if self.node_rank is not None:  # torch's static handler: its timeout bounds the wait for all hosts
            return {**self.rdzv_conf, "rank": self.node_rank}
        configs = {
            **self.rdzv_conf,
            "is_host": self.serves_store(),
            "read_timeout": self.read_timeout_s(collective_timeout_s),
        }
        if (rejoin := self.rejoin_timeout_s(collective_timeout_s)) is not None:
            configs[REJOIN_TIMEOUT] = rejoin
        return configs


def nodes_from_flags(
    *,
    nnodes: str | None,
    rdzv_endpoint: str | None,
    rdzv_id: str | None,
    local_addr: str | None,
    rdzv_conf: str | None,
    node_rank: int | None,
) -> Nodes | None:
    """torchrun's multi-node flags (as `dpscale train` and `dpscale scale` take them) as a Nodes
    config, or None for a job on this host; ConfigError naming the flag that is missing."""
    multi = (rdzv_endpoint, rdzv_id, local_addr, rdzv_conf, node_rank)
    if nnodes is None:
        if any(v is not None for v in multi):
            raise ConfigError(
                "--rdzv-endpoint, --rdzv-id, --local-addr, --rdzv-conf and --node-rank need --nnodes"
            )
        return None
    if rdzv_endpoint is None or rdzv_id is None:
        raise ConfigError(
            "--nnodes needs --rdzv-endpoint HOST:PORT and --rdzv-id NAME (the same on every host)"
        )
    min_nodes, max_nodes = parse_nnodes(nnodes)
    return Nodes(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_id=rdzv_id,
        local_addr=local_addr,
        rdzv_conf=parse_rdzv_conf(rdzv_conf),
        node_rank=node_rank,
    )


def parse_min_max(flag: str, text: str) -> tuple[int, int]:
    """`N` or `MIN:MAX` -> (min, max), torchrun's syntax for --nnodes and an elastic --nproc;
    ConfigError naming `flag` and saying what is accepted."""
    parts = str(text).split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, 0)
    except ValueError:
        low = high = 0
    if not 1 <= low <= high:
        raise ConfigError(f"{flag} must be N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return low, high


def parse_nnodes(text: str) -> tuple[int, int]:
    return parse_min_max("--nnodes", text)


def parse_rdzv_conf(text: str | None) -> dict[str, str]:
    """`k=v,k2=v2` -> dict (torchrun's format); ValueError naming the bad item."""
    conf = {}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--rdzv-conf takes key=value pairs separated by commas, got {item!r}")
        conf[key.strip()] = value.strip()
    return conf


def carries_address(host: str) -> bool:
    """Whether one of this host's interfaces carries `host`'s address (binding to it succeeds)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))  # only an address of this host's interfaces binds
            return True
        except OSError:
            continue
    return False


def rendezvous_warning(addr: str | None) -> str | None:
    """A warning if workers meet at a non-loopback address, else None."""
    if not addr:
        return None
    try:
        # every address the name resolves to: "localhost" may also resolve to a public one
        addresses = {info[4][0] for info in socket.getaddrinfo(addr, None)}
        loopback = all(ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in addresses)
    except (OSError, ValueError):
        loopback = False
    if loopback:
        return None
    return (
        f"dpscale: warning: workers rendezvous at {addr}, which is not a loopback address. torch's "
        "rendezvous store has no authentication: anyone who can reach it can join or disrupt the job. "
        "Run multi-host jobs on a trusted network only (docs/fault-tolerance.md)."
    )
