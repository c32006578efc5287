"""The lab's measurements across hosts: torchrun's multi-node flags, and ranks started on every host.

`HostFlags` holds the flags `dpscale scale` and `dpscale bench scaling` take to run across hosts,
with `dpscale train`'s names and meanings (launch/nodes.py): the same command on every host, a
fixed number of hosts. Each world size N > 1 is then one torchrun job of H hosts x N/H workers with
its own rendezvous id; the 1-worker baseline runs on one host, the one serving the rendezvous store.

`run_ranks_across_hosts` is `multirank.run_ranks` for such a job: this host's workers run
`python -m dpscale.launch.hosts WORKDIR`, which calls the rank function and gathers every rank's
result inside the job, so every host gets them all with no shared directory.
"""

from __future__ import annotations

import datetime
import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dpscale.errors import ConfigError
from dpscale.flags import flag_spec
from dpscale.launch.nodes import Nodes, nodes_from_flags
from dpscale.launch.process_life import die_with_parent, guarded_module
from dpscale.launch.rendezvous import MULTI_HOST_BACKEND

GROUP = "across hosts (the same command on every host)"  # their --help section, after the bench's own


@dataclass(frozen=True, kw_only=True)
class HostFlags:
    """Across hosts: torchrun's flags with `dpscale train`'s names and meanings (launch/nodes.py)."""

    nnodes: int | None = field(default=None, metadata=flag_spec(group=GROUP))
    """hosts, a fixed number (the same command on every host); each world size > 1 is split evenly
    over them"""
    rdzv_endpoint: str | None = field(default=None, metadata=flag_spec(group=GROUP))
    """HOST:PORT of the rendezvous store (multi-host)"""
    rdzv_id: str | None = field(default=None, metadata=flag_spec(group=GROUP))
    """the measurement's name, the same on every host; each job's rendezvous id is ID-...-nN"""
    local_addr: str | None = field(default=None, metadata=flag_spec(group=GROUP))
    """the address other hosts reach this one at"""
    rdzv_conf: str | None = field(default=None, metadata=flag_spec(group=GROUP))
    """k=v,... passed to torch's rendezvous (e.g. is_host=1, join_timeout=600); rejoin_timeout=S:
    how long the hosts wait for each other after a failure (default: collective timeout + 20 s)"""
    node_rank: int | None = field(default=None, metadata=flag_spec(group=GROUP))
    """this host's rank 0..H-1 for a static rendezvous (default: the rendezvous numbers the hosts)"""

    def check_hosts(self, world_sizes: list[int], flag: str = "--nproc") -> None:
        """ConfigError naming the flag when the multi-host flags are incomplete or a world size
        does not split evenly over the hosts."""
        self.nodes()
        if self.nnodes is None:
            return
        uneven = [n for n in world_sizes if n > 1 and n % self.nnodes]
        if uneven:
            raise ConfigError(
                f"{flag}: world sizes {uneven} do not split evenly over --nnodes {self.nnodes} hosts; "
                f"give 1 (the one-host baseline) or multiples of {self.nnodes}"
            )

    def nodes(self) -> Nodes | None:
        """The multi-host flags as a Nodes config, or None for a measurement on this host."""
        return nodes_from_flags(
            nnodes=None if self.nnodes is None else str(self.nnodes),
            rdzv_endpoint=self.rdzv_endpoint,
            rdzv_id=self.rdzv_id,
            local_addr=self.local_addr,
            rdzv_conf=self.rdzv_conf,
            node_rank=self.node_rank,
        )


def job_nodes(nodes: Nodes | None, n: int, name: str) -> Nodes | None | bool:
    """Where world size `n` runs: None on this host alone, a Nodes for the job across the hosts
    (rendezvous id ID-NAME-nN), or False where this host skips it (the baseline runs on one host)."""
    if nodes is None:
        return None
    if n == 1:
        return None if nodes.serves_store() else False
    return replace(nodes, rdzv_id=f"{nodes.rdzv_id}-{name}-n{n}")


def run_ranks_across_hosts(
    fn: Callable[..., Any], world_size: int, *args: Any, nodes: Nodes, threads: int, timeout_s: float
) -> list[Any]:
    """`fn(rank, world_size, *args)` on every rank of a job over `nodes`' hosts (world_size / hosts
    workers here, gloo); every rank's result, on every host."""
    with tempfile.TemporaryDirectory(prefix="dpscale-hosts-") as workdir:
        job = Path(workdir)
        (job / "job.pkl").write_bytes(pickle.dumps((fn, args, threads, max(5.0, timeout_s - 10.0))))
        per_host = f"--nproc-per-node={world_size // nodes.max_nodes}"
        # the agent ends with this process, its workers with the agent (process_life.py)
        cmd = guarded_module(
            "torch.distributed.run",
            *torchrun_node_args(nodes),
            per_host,
            "-m",
            "dpscale.launch.hosts",
            workdir,
        )
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"world size {world_size} across hosts did not finish within {timeout_s:.0f} s"
            ) from None
        if p.returncode != 0 or not (job / "results.pkl").is_file():
            tail = "\n".join((p.stdout + p.stderr).splitlines()[-20:])
            raise RuntimeError(f"world size {world_size} across hosts failed (exit {p.returncode}):\n{tail}")
        return pickle.loads((job / "results.pkl").read_bytes())


def torchrun_node_args(nodes: Nodes) -> list[str]:
    """torchrun's flags for one host of a multi-host job: what the user named, nothing else."""
    args = [f"--nnodes={nodes.min_nodes}:{nodes.max_nodes}", f"--rdzv-endpoint={nodes.rdzv_endpoint}"]
    args.append(f"--rdzv-id={nodes.rdzv_id}")
    if nodes.local_addr is not None:
        args.append(f"--local-addr={nodes.local_addr}")
    if nodes.node_rank is not None:  # torch's static rendezvous: the host of rank 0 serves the store
        args += ["--rdzv-backend=static", f"--node-rank={nodes.node_rank}"]
        conf: dict[str, object] = dict(nodes.rdzv_conf)
    else:  # is_host decided by the address, not torch's guess from the host name (nodes.py)
        args.append(f"--rdzv-backend={MULTI_HOST_BACKEND}")
        conf = {k: int(v) if isinstance(v, bool) else v for k, v in nodes.rdzv_configs().items()}
    if conf:
        args.append("--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items()))
    return args


def main(workdir: str) -> None:
    """One worker of `run_ranks_across_hosts` (torchrun set RANK, WORLD_SIZE, MASTER_*)."""
    import torch
    import torch.distributed as dist

    from dpscale.comm.attempt import gloo_interface_hint

    die_with_parent(os.getppid())  # torchrun's agent
    fn, args, threads, pg_timeout_s = pickle.loads((Path(workdir) / "job.pkl").read_bytes())
    torch.set_num_threads(threads)
    # a host whose name resolves to loopback would make gloo advertise 127.0.0.1 to the others
    if ifname := gloo_interface_hint(os.environ.get("MASTER_ADDR")):
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=pg_timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    results = [None] * world
    dist.all_gather_object(results, fn(rank, world, *args))
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        tmp = Path(workdir) / "results.tmp"
        tmp.write_bytes(pickle.dumps(results))
        tmp.replace(Path(workdir) / "results.pkl")
    dist.barrier()
    dist.destroy_process_group()
    # torch may keep gloo's threads alive past this point; leaving through os._exit avoids the
    # abort at interpreter shutdown that would turn a finished run into a failed one (issue #20)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
