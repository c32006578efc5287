"""dpscale's engine vs torch DDP on one GPU, NCCL at world size 1 (run by scripts/gpu-check.sh).

The model is a ~124 M-parameter decoder (d=768, 12 layers, seq 512, tied embeddings, bf16
autocast), written here in plain torch: nothing to download. World size 1 on NCCL measures what
the engine itself adds on the GPU path (bucket copies, hooks, the communication stream).

Each engine runs in rounds, alternating (A B, then B A, ...) so that drift favours neither. A
round is a window of steps timed by two CUDA events around it, with no sync inside it: the
step time is the window's device time over its steps, and the host CPU time per step is
`time.process_time` over the same window. Syncs per step are counted over a separate short
window with `torch.cuda.set_sync_debug_mode("warn")` (each synchronizing call warns once).
The figures are medians over rounds, with their spread, and dpscale / torch.

`--device cpu` (or `--dry-run`) runs the same code with tiny sizes on gloo and the host clock:
what a CPU test checks (tests/test_gpu_check.py); its times mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from dpscale.engine.clock import clock_for  # noqa: E402
from dpscale.engine.factory import wrap  # noqa: E402

ENGINES = ("dpscale", "torch")
TARGET_RATIO = 1.02  # dpscale's step at most 2% over torch DDP's (issue #30)


@dataclass(frozen=True)
class BenchConfig:
    device: str = "cuda"
    vocab: int = 50304
    d_model: int = 768
    layers: int = 12
    heads: int = 12
    seq: int = 512
    batch: int = 8  # sequences per step
    rounds: int = 6  # per engine
    window_steps: int = 15  # steps in one timed window (10-20: enough to hide the events' cost)
    warmup_steps: int = 5
    sync_steps: int = 3  # steps whose synchronizing calls are counted

    @classmethod
    def tiny(cls) -> BenchConfig:
        """CPU sizes for the dry run: seconds, not minutes."""
        return cls(
            device="cpu", vocab=64, d_model=32, layers=2, heads=2, seq=16, batch=2, rounds=2, window_steps=3,
            warmup_steps=1, sync_steps=1,
        )  # fmt: skip


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Decoder(nn.Module):
    """GPT-2-small shaped: token and position embeddings, pre-norm blocks, a tied output layer."""

    def __init__(self, c: BenchConfig):
        super().__init__()
        self.tok, self.pos = nn.Embedding(c.vocab, c.d_model), nn.Embedding(c.seq, c.d_model)
        self.blocks = nn.ModuleList(Block(c.d_model, c.heads) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.tok.weight.t()


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@dataclass
class Round:
    """One timed window of one engine."""

    engine: str
    step_ms: float  # device time over the window / its steps
    cpu_ms: float  # host CPU time (process_time) over the window / its steps


def alternate(engines: tuple[str, ...], rounds: int) -> list[str]:
    """The order engines run in: A B, B A, A B, ...: each goes first as often as the other."""
    order: list[str] = []
    for r in range(rounds):
        order += list(engines) if r % 2 == 0 else list(reversed(engines))
    return order


def spread(values: list[float]) -> dict:
    """Median, min, max and (max - min) / median of one figure over rounds."""
    med = statistics.median(values)
    return {
        "median": med,
        "min": min(values),
        "max": max(values),
        "spread": (max(values) - min(values)) / med if med else math.nan,
    }


def summarize(rounds: list[Round], syncs_per_step: dict[str, float | None], config: BenchConfig) -> dict:
    """The JSON figures of a run: per engine, per round and as medians; dpscale / torch."""
    engines: dict[str, dict] = {}
    for e in ENGINES:
        mine = [r for r in rounds if r.engine == e]
        engines[e] = {
            "step_ms": spread([r.step_ms for r in mine]),
            "cpu_ms_per_step": spread([r.cpu_ms for r in mine]),
            "syncs_per_step": syncs_per_step.get(e),
            "rounds_step_ms": [r.step_ms for r in mine],
        }
    ratio = engines["dpscale"]["step_ms"]["median"] / engines["torch"]["step_ms"]["median"]
    # rounds pair up in time (A B / B A): the median of the per-pair ratios resists drift
    pairs = zip(engines["dpscale"]["rounds_step_ms"], engines["torch"]["rounds_step_ms"], strict=True)
    return {
        "config": asdict(config),
        "engines": engines,
        "ratio_dpscale_torch": ratio,
        "ratio_per_round_median": statistics.median(a / b for a, b in pairs),
        "target_ratio": TARGET_RATIO,
        "within_target": ratio <= TARGET_RATIO,
    }


@contextlib.contextmanager
def count_syncs(device: torch.device) -> Iterator[list[int]]:
    """Counts the synchronizing CUDA calls inside the block (`[n]` once it ends); on a CPU,
    where nothing synchronizes a device, it stays empty."""
    found: list[int] = []
    if device.type != "cuda":
        yield found
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found.append(sum("synchroniz" in str(w.message) for w in caught))


def make_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, c: BenchConfig):
    device_type = torch.device(c.device).type
    bf16 = device_type == "cuda"  # bf16 autocast on the GPU; fp32 on the CPU dry run

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, c.vocab), y.view(-1))
        loss.backward()
        opt.step()

    return step


def time_window(step: Callable[[], None], steps: int, device: torch.device) -> tuple[float, float]:
    """(device ms, host CPU ms) per step over `steps` steps: two stamps of the engine's clock
    around the window, read once after it (the one wait, outside the window)."""
    clock = clock_for(device)
    cpu0 = time.process_time()
    start = clock.stamp()
    for _ in range(steps):
        step()
    end = clock.stamp()
    cpu_ms = (time.process_time() - cpu0) * 1e3 / steps
    clock.wait([start, end])
    return clock.elapsed_ms(start, end) / steps, cpu_ms


def build(engine: str, c: BenchConfig, device: torch.device):
    torch.manual_seed(0)  # the same weights for both engines
    model = Decoder(c).to(device)
    ids = [device.index or 0] if device.type == "cuda" else None
    model = wrap(model, engine, device_ids=ids)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def bench(c: BenchConfig) -> dict:
    """Both engines on the default process group (world size 1), alternating rounds."""
    device = torch.device(c.device)
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, c.vocab, (c.batch, c.seq + 1), generator=g).to(device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    steps, params = {}, 0
    for e in ENGINES:
        model, opt = build(e, c, device)
        params = param_count(model)
        steps[e] = make_step(model, opt, x, y, c)
        for _ in range(c.warmup_steps):
            steps[e]()
    syncs: dict[str, float | None] = {}
    for e in ENGINES:
        steps[e]()  # finish lazy state (optimizer, buckets) before counting
        if device.type == "cuda":
            torch.cuda.synchronize()
        with count_syncs(device) as found:
            for _ in range(c.sync_steps):
                steps[e]()
        syncs[e] = found[0] / c.sync_steps if found else None
    rounds = [Round(e, *time_window(steps[e], c.window_steps, device)) for e in alternate(ENGINES, c.rounds)]
    return {"params": params, **summarize(rounds, syncs, c)}


def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(device)}
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    return env


def run(c: BenchConfig) -> dict:
    """The bench in this process on a one-rank group: NCCL on a GPU, gloo on a CPU."""
    device = torch.device(c.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as d:
        store = dist.FileStore(os.path.join(d, "store"), 1)
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, store=store, rank=0, world_size=1, **kwargs)
        try:
            result = bench(c)
        finally:
            dist.destroy_process_group()
    return {"backend": backend, "world_size": 1, **environment(device), **result}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--out", default="reports/gpu-check", help="directory for engine-bench.json")
    p.add_argument("--device", default="cuda", help="cuda (the bench) or cpu (tiny sizes, a dry run)")
    p.add_argument("--dry-run", action="store_true", help="same as --device cpu")
    p.add_argument("--rounds", type=int, default=None, help="timed windows per engine")
    args = p.parse_args(argv)
    c = BenchConfig.tiny() if args.dry_run or args.device == "cpu" else BenchConfig(device=args.device)
    if args.rounds is not None:
        if args.rounds < 1:
            p.error("--rounds: must be >= 1")
        c = BenchConfig(**{**asdict(c), "rounds": args.rounds})
    if torch.device(c.device).type == "cuda" and not torch.cuda.is_available():
        print("gpu_engine_bench: no CUDA device; use --device cpu for a dry run", file=sys.stderr)
        return 2
    result = run(c)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "engine-bench.json").write_text(json.dumps(result, indent=2))
    e = result["engines"]
    print(
        f"params {result['params'] / 1e6:.1f} M; step ms dpscale {e['dpscale']['step_ms']['median']:.3f} "
        f"torch {e['torch']['step_ms']['median']:.3f}; ratio {result['ratio_dpscale_torch']:.3f} "
        f"(target <= {TARGET_RATIO}); syncs/step dpscale {e['dpscale']['syncs_per_step']} "
        f"torch {e['torch']['syncs_per_step']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
