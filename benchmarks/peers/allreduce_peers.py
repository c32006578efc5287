"""CPU all-reduce on one host: dpscale's shm against its peers, side by side in one run (issue 32).

    python benchmarks/peers/allreduce_peers.py --out DIR [--world-sizes 2,4] [--rounds 6]
        [--sizes 4,16,...,256M] [--peers dpscale,dpscale-staged,gloo-2.13,gloo-2.14.1,deepspeed,mpi]
        [--peers-python /work/venvs/peers/bin/python] [--t2141-python .venv-compat/bin/python]
        [--busy 0] [--threads N] [--iter-bytes 64M] [--no-stream] [--base-src WORKTREE/src]

Run it with dpscale's interpreter from the repository root (benchmarks/peers/README.md sets up the
peers' environment). Every peer runs as its own set of ranks, each with its interpreter
(`peer_worker.py`); all of them stay up for the whole run, and the driver sends each set one
round of the full size sweep in turn, the order rotating every round, so that drifts of a shared
host fall on every peer alike. Every peer reduces the same sizes of a float32 buffer in place, with
the same warm-up and the same number of timed calls per size and round; before its first round
each checks its sum. A call's time is the slowest rank's (what the next collective waits for); a
point is the median over every round's calls, with p10-p90, in nccl-tests' terms:
algbw = bytes / time, busbw = algbw x 2(n-1)/n.

The memory bound: a STREAM-style copy and add (stream.c, built with gcc) at 1 and as many threads
as ranks, and busbw <= B (n-1)/n^2 for an in-place all-reduce through shared memory (README.md
derives it). Peer `dpscale-base` is dpscale from another checkout (`--base-src`), for an A/B of a
change in the same rounds as the peers. Writes DIR/results.json, DIR/results.md and DIR/busbw.png
(peers_report.py renders the last two from the first).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

from peers_report import render  # noqa: E402

PEERS = ("dpscale", "dpscale-base", "dpscale-staged", "gloo-2.13", "gloo-2.14.1", "deepspeed", "mpi")
DEFAULT_SIZES = [4 * 4**k for k in range(14)]  # 4 B, 16 B, ..., 64 MiB, 256 MiB
WARMUP = 3
READY_TIMEOUT_S = 900  # DeepSpeed builds its op with gcc on first use (minutes on a small host)
ROUND_TIMEOUT_S = 900


def _size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    value = int(text[:-1] if scale > 1 else text) * scale
    if value < 4:
        raise argparse.ArgumentTypeError(f"{text}: sizes are >= 4 bytes (one float32)")
    return value


def _sizes(text: str) -> list[int]:
    return sorted({_size(t) // 4 * 4 for t in text.split(",") if t.strip()})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(rank: int) -> dict[str, str]:
    # LOCAL_RANK too: without it deepspeed.init_distributed goes looking for MPI to find the ranks
    return {"RANK": str(rank), "LOCAL_RANK": str(rank)}


class PeerSet:
    """One peer's ranks: processes, their named pipes, and the exchange of one JSON line each."""

    def __init__(self, name: str, world: int, argv_env: tuple[list[list[str]], dict], ctl: Path, log: Path):
        self.name, self.world, self.ctl = name, world, ctl
        argvs, env = argv_env
        self.port = env.get("MASTER_PORT")
        for r in range(world):
            os.mkfifo(ctl / f"cmd.{r}")
            os.mkfifo(ctl / f"res.{r}")
        self.log = open(log, "w")  # noqa: SIM115 (closed in close())
        self.procs = [
            subprocess.Popen(
                argv,
                env={**env, **_rank_env(i)},
                stdin=subprocess.DEVNULL,
                stdout=self.log,
                stderr=subprocess.STDOUT,
            )
            for i, argv in enumerate(argvs)
        ]
        self.cmd_fds: list[int] = []
        self.res_fds: list[int] = []
        self.pending = [b""] * world
        self.info: dict = {}

    def _alive_or_raise(self) -> None:
        for p in self.procs:
            if p.poll() not in (None, 0):
                raise RuntimeError(f"{self.name}: a rank exited with {p.returncode}; see {self.log.name}")

    def connect(self, deadline: float) -> None:
        for r in range(self.world):
            while True:  # a writer's open fails (ENXIO) until the rank has opened its end
                try:
                    self.cmd_fds.append(os.open(self.ctl / f"cmd.{r}", os.O_WRONLY | os.O_NONBLOCK))
                    break
                except OSError:
                    self._alive_or_raise()
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{self.name}: rank {r} did not start") from None
                    time.sleep(0.05)
            os.set_blocking(self.cmd_fds[-1], True)
            self.res_fds.append(os.open(self.ctl / f"res.{r}", os.O_RDONLY | os.O_NONBLOCK))
        ready = self.receive(deadline)
        self.info = ready[0]["info"]

    def send(self, doc: dict) -> None:
        line = (json.dumps(doc) + "\n").encode()
        for fd in self.cmd_fds:
            os.write(fd, line)

    def _line(self, r: int, deadline: float) -> dict:
        while b"\n" not in self.pending[r]:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: rank {r} sent nothing in time; see {self.log.name}")
            ready, _, _ = select.select([self.res_fds[r]], [], [], min(left, 1.0))
            chunk = os.read(self.res_fds[r], 1 << 20) if ready else b""
            if not chunk:  # nothing yet, or no writer yet (a FIFO reads as empty then)
                self._alive_or_raise()
                time.sleep(0.01 if ready else 0)
            self.pending[r] += chunk
        line, _, rest = self.pending[r].partition(b"\n")
        self.pending[r] = rest
        return json.loads(line)

    def receive(self, deadline: float) -> list[dict]:
        return [self._line(r, deadline) for r in range(self.world)]

    def close(self) -> None:
        try:
            self.send({"quit": True})
        except OSError:
            pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for fd in self.cmd_fds + self.res_fds:
            os.close(fd)
        self.log.close()
        if self.name == "deepspeed" and self.port:
            # DeepSpeed names its segments in /dev/shm and never unlinks them
            for f in Path("/dev/shm").glob(
                f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{self.port}_*"
            ):
                f.unlink(missing_ok=True)


def _interpreter(peer: str, args) -> tuple[str | None, str]:
    """(python, why not) for a peer."""
    if peer == "dpscale-base" and not (args.base_src and (Path(args.base_src) / "dpscale").is_dir()):
        return None, f"--base-src {args.base_src!r} is not a source tree holding dpscale/"
    if peer in ("dpscale", "dpscale-base", "dpscale-staged", "gloo-2.13"):
        return sys.executable, ""
    path = args.t2141_python if peer == "gloo-2.14.1" else args.peers_python
    if not path or not os.access(path, os.X_OK):
        return None, f"no interpreter at {path!r} (see benchmarks/peers/README.md)"
    return path, ""


def _launch_spec(peer: str, python: str, world: int, ctl: Path, args) -> tuple[list[list[str]], dict]:
    worker = [str(HERE / "peer_worker.py"), "--peer", peer, "--ctl", str(ctl)]
    worker += ["--threads", str(args.threads), "--max-bytes", str(max(args.sizes)), "--wait", args.wait]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    threads = str(args.threads)
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads)
    if peer.startswith("dpscale"):
        env["PYTHONPATH"] = str(args.base_src if peer == "dpscale-base" else REPO / "src")
    if peer == "mpi":
        mpirun = ["mpirun", "-n", str(world), "--bind-to", "none", "--mca", "btl", "self,vader"]
        mpirun += ["--oversubscribe"] if world > (os.cpu_count() or 1) else []
        mpirun += ["--allow-run-as-root"] if os.geteuid() == 0 else []
        return [mpirun + [python] + worker], env
    port = str(_free_port())
    # LOCAL_WORLD_SIZE turns on gloo's shared-memory all-reduce where the build has it (gloo PR
    # #458); LOCAL_SIZE turns on DeepSpeed's. torchrun sets the first for every job on one host.
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(world))
    env.update(LOCAL_WORLD_SIZE=str(world), LOCAL_SIZE=str(world), DS_ACCELERATOR="cpu")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(args.peers_python).parent.parent / "torch_extensions"))
    argvs = [[python] + worker + ["--rank", str(r), "--world", str(world)] for r in range(world)]
    return argvs, env


def _iters(nbytes: int, args) -> int:
    return max(args.min_iters, min(args.max_iters, args.iter_bytes // nbytes))


def _measure_world(world: int, peers: list[str], args, work: Path) -> dict:
    """Every peer's calls at this world size: {peer: {"info", "times_s": [size][call]}}."""
    sets: dict[str, PeerSet] = {}
    skipped: dict[str, str] = {}
    iters = [_iters(s, args) for s in args.sizes]
    try:
        for peer in peers:
            python, why = _interpreter(peer, args)
            if python is None:
                skipped[peer] = why
                continue
            ctl = Path(tempfile.mkdtemp(prefix=f"{peer}-", dir=work))
            spec = _launch_spec(peer, python, world, ctl, args)
            sets[peer] = PeerSet(peer, world, spec, ctl, work / f"{peer}-n{world}.log")
        for peer, s in list(sets.items()):
            try:
                s.connect(time.monotonic() + READY_TIMEOUT_S)
            except (RuntimeError, TimeoutError) as e:
                skipped[peer] = str(e)
                s.close()
                del sets[peer]
        times: dict[str, list[list[float]]] = {p: [[] for _ in args.sizes] for p in sets}
        errors: dict[str, list[str]] = {}
        names = list(sets)
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)] if names else []
            for peer in order:
                cmd = {"sizes": args.sizes, "iters": iters, "warmup": WARMUP, "check": r == 0}
                try:
                    sets[peer].send(cmd)
                    per_rank = sets[peer].receive(time.monotonic() + ROUND_TIMEOUT_S)
                except (OSError, RuntimeError, TimeoutError) as e:
                    # one peer failing ends its series, not the run
                    skipped[peer] = f"failed in round {r + 1}: {e}"
                    sets.pop(peer).close()
                    names.remove(peer)
                    del times[peer]
                    continue
                errors.setdefault(peer, []).extend(e for d in per_rank for e in d["errors"])
                for i in range(len(args.sizes)):
                    # a call's time is the slowest rank's
                    calls = zip(*(d["times_s"][i] for d in per_rank), strict=True)
                    times[peer][i].extend(max(c) for c in calls)
            print(f"  n={world} round {r + 1}/{args.rounds} done; load {os.getloadavg()[0]:.1f}", flush=True)
        return {p: {"info": sets[p].info, "times_s": times[p], "errors": errors.get(p, [])} for p in sets} | {
            p: {"skipped": why} for p, why in skipped.items()
        }
    finally:
        for s in sets.values():
            s.close()


def _quantile(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    k = (len(ys) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(ys) - 1)
    return ys[lo] + (ys[hi] - ys[lo]) * (k - lo)


def _points(world: int, measured: dict, sizes: list[int], args) -> list[dict]:
    points = []
    per_round = [_iters(s, args) for s in sizes]
    for peer, m in measured.items():
        if "skipped" in m:
            continue
        for nbytes, calls, n_round in zip(sizes, m["times_s"], per_round, strict=True):
            t = statistics.median(calls)
            algbw = nbytes / t / 1e9
            rounds = [statistics.median(calls[i : i + n_round]) * 1e6 for i in range(0, len(calls), n_round)]
            points.append(
                {
                    "peer": peer,
                    "world_size": world,
                    "bytes": nbytes,
                    "time_us": t * 1e6,
                    "time_us_p10": _quantile(calls, 0.1) * 1e6,
                    "time_us_p90": _quantile(calls, 0.9) * 1e6,
                    "algbw_GBps": algbw,
                    "busbw_GBps": algbw * 2 * (world - 1) / world,
                    "calls": len(calls),
                    "round_medians_us": rounds,
                }
            )
    return points


def _stream(args, work: Path) -> dict | None:
    """STREAM copy/add at 1 and 2 threads (and each world size's), None where gcc is missing."""
    gcc = shutil.which("gcc")
    if gcc is None:
        print("no gcc: the memory bound is not measured", file=sys.stderr)
        return None
    exe = work / "stream"
    subprocess.run([gcc, "-O2", "-fopenmp", "-o", str(exe), str(HERE / "stream.c")], check=True)
    out = {}
    cores = os.cpu_count() or 1
    for threads in sorted({1, 2, *(min(n, cores) for n in args.world_sizes)}):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_PROC_BIND": "false"}
        run = subprocess.run([str(exe), str(args.stream_mib), "10"], env=env, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"stream failed: {run.stderr or run.stdout}")
        out[str(threads)] = json.loads(run.stdout)
    return out


def _busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for results.json/.md and busbw.png")
    p.add_argument("--world-sizes", default="2", help="comma-separated, e.g. 2,4 (default 2)")
    p.add_argument("--sizes", type=_sizes, default=DEFAULT_SIZES, help="comma-separated, binary K/M/G")
    p.add_argument(
        "--peers",
        default=",".join(p for p in PEERS if p != "dpscale-base"),
        help=f"comma-separated from {', '.join(PEERS)}",
    )
    p.add_argument("--rounds", type=int, default=6, help="alternating rounds of the whole sweep")
    p.add_argument(
        "--iter-bytes",
        type=_size,
        default=64 << 20,
        help="timed calls per size and round: this / size, within --min-iters..--max-iters (default 64M)",
    )
    p.add_argument("--min-iters", type=int, default=5)
    p.add_argument("--max-iters", type=int, default=100)
    p.add_argument("--threads", type=int, default=0, help="threads per rank (default: cores / ranks, >= 1)")
    p.add_argument("--wait", default="block", help="dpscale's shm wait policy (block or spin)")
    p.add_argument("--busy", type=int, default=0, help="busy-looping processes to run meanwhile")
    p.add_argument(
        "--base-src",
        help="peer dpscale-base: another checkout's src folder (a git worktree of the base revision), "
        "timed beside this one's dpscale in the same rounds",
    )
    p.add_argument("--peers-python", default="/work/venvs/peers/bin/python")
    p.add_argument("--t2141-python", default=str(REPO / ".venv-compat/bin/python"))
    p.add_argument("--stream-mib", type=int, default=512, help="MiB per STREAM array (3 arrays)")
    p.add_argument("--no-stream", action="store_true", help="skip the memory-bandwidth measurement")
    args = p.parse_args(argv)
    args.world_sizes = [int(x) for x in args.world_sizes.split(",")]
    peers = [x.strip() for x in args.peers.split(",") if x.strip()]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        p.error(f"--peers: unknown {', '.join(unknown)}; choose from {', '.join(PEERS)}")
    args.peers = peers
    if args.rounds < 1 or args.min_iters < 1 or args.max_iters < args.min_iters or args.busy < 0:
        p.error("--rounds and --min-iters must be >= 1, --max-iters >= --min-iters, --busy >= 0")
    if any(n < 2 for n in args.world_sizes):
        p.error("--world-sizes: each must be >= 2 (one rank moves no data)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    started = time.time()
    doc: dict = {
        "config": {k: v for k, v in vars(args).items() if k != "out"} | {"warmup": WARMUP},
        "host": {"cores": cores, "load_before": os.getloadavg()[0], "cpu": _cpu_name()},
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "points": [],
        "peers": {},
        "worlds": {},
    }
    busy = _busy(args.busy)
    work = Path(tempfile.mkdtemp(prefix="allreduce-peers-"))
    try:
        doc["stream"] = None if args.no_stream else _stream(args, work)
        requested_threads = args.threads
        for world in args.world_sizes:
            threads = requested_threads or max(1, cores // world)
            args.threads = threads
            over = " (oversubscribed)" if world > cores else ""
            print(f"world size {world}{over}, {threads} thread(s) a rank", flush=True)
            measured = _measure_world(world, args.peers, args, work)
            doc["points"] += _points(world, measured, args.sizes, args)
            doc["peers"][str(world)] = {
                p: {k: v for k, v in m.items() if k != "times_s"} for p, m in measured.items()
            }
            doc["worlds"][str(world)] = {"oversubscribed": world > cores, "threads_per_rank": threads}
        doc["host"]["load_after"] = os.getloadavg()[0]
        doc["wall_s"] = time.time() - started
        for log in work.glob("*.log"):
            shutil.copy(log, args.out / log.name)
    finally:
        for b in busy:
            b.kill()
            b.wait()
        shutil.rmtree(work, ignore_errors=True)
    (args.out / "results.json").write_text(json.dumps(doc, indent=1))
    print(render(doc, args.out))
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


if __name__ == "__main__":
    sys.exit(main())
