"""`dpscale check equivalence`: does data parallelism reproduce one big batch for *your* loss?

The standard recipe is: each of W workers computes the loss on its G/W samples and the engine
averages the gradients; with k accumulation steps each micro-batch's loss is divided by k. Both
equal the full-batch gradient only when the loss is a mean over samples. A loss summed over
samples (or averaged over a varying number of tokens) silently breaks that, and the run trains
with a different effective learning rate. This check runs a few SGD steps three ways and compares:

- reference: one process, the whole global batch per step;
- workers: W processes through dpscale's engine, each on its share;
- accumulation: one process, k micro-batches per step with loss / k.

For a built-in workload the loss is the workload's per-sample sum divided by the batch, i.e. a
mean, so the check passes; point `--model module:callable` at your own model and loss.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import cast

import torch

from dpscale.engine import DistributedDataParallel
from dpscale.errors import ConfigError
from dpscale.flags import flag_spec
from dpscale.lab.multirank import run_ranks
from dpscale.lab.recipe import TASK_CONVENTION, is_task_spec, load_recipe

# fp32 sums in another order differ by a few ulps per step; anything past this is a real difference
REL_TOLERANCE = 1e-4
LR = 0.05


@dataclass
class Comparison:
    name: str
    rel_diff: float  # max over steps of |params - reference params| / |reference params change|
    grad_norm_ratio: float  # |first-step gradient| / |reference first-step gradient|
    ok: bool
    hint: str


@dataclass
class EquivalenceResult:
    model: str
    world_size: int
    accumulation_steps: int
    global_batch: int
    steps: int
    comparisons: list[Comparison]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.comparisons)

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def _batches(recipe, steps: int, global_batch: int) -> list[tuple[object, object]]:
    g = torch.Generator().manual_seed(1234)
    return [recipe.make_batch(global_batch, g) for _ in range(steps)]


def _flat(model: torch.nn.Module, grads: bool = False) -> torch.Tensor:
    ps = [cast(torch.Tensor, p.grad) if grads else p for p in model.parameters() if p.requires_grad]
    return torch.cat([t.detach().reshape(-1).double() for t in ps])


def _train(
    spec: str,
    steps: int,
    global_batch: int,
    parts: int,
    part: int | None,
    accumulation: int,
    model: torch.nn.Module | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Run `steps` SGD steps; returns parameters after each step and the first step's gradient."""
    recipe = load_recipe(spec)
    torch.manual_seed(0)
    model = model if model is not None else recipe.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    history, first_grad = [], None
    share = global_batch // parts
    micro = share // accumulation
    for x, y in _batches(recipe, steps, global_batch):
        start = 0 if part is None else part * share  # this worker's share of the global batch
        opt.zero_grad()
        for m in range(accumulation):
            xm, ym = recipe.take(x, y, slice(start + m * micro, start + (m + 1) * micro))
            # the Trainer's normalization: summed per-sample losses / the global batch, times the
            # number of workers because the engine averages their gradients
            (recipe.loss(recipe.forward(model, xm), ym) * parts / global_batch).backward()
        if first_grad is None:
            first_grad = _flat(model, grads=True)
        opt.step()
        history.append(_flat(model))
    assert first_grad is not None  # steps >= 1 (run checks it)
    return history, first_grad


def _worker(rank: int, world: int, spec: str, steps: int, global_batch: int):
    recipe = load_recipe(spec)
    torch.manual_seed(0)
    ddp = DistributedDataParallel(recipe.build_model())
    return _train(spec, steps, global_batch, world, rank, 1, model=ddp)


def _compare(name: str, runs, ref, initial: torch.Tensor, factor_hint: tuple[int, str]) -> Comparison:
    history, grad = runs
    ref_history, ref_grad = ref
    rel = max(
        float((a - b).norm() / max((b - initial).norm(), 1e-30))
        for a, b in zip(history, ref_history, strict=True)
    )
    ratio = float(grad.norm() / max(ref_grad.norm(), 1e-30))
    ok = rel <= REL_TOLERANCE
    hint = ""
    if not ok:
        factor, what = factor_hint
        if abs(ratio * factor - 1) < 0.05 or abs(ratio / factor - 1) < 0.05:
            hint = (
                f"gradients are {ratio:.3g}x the full-batch gradient ({what}): the loss looks summed over "
                "samples rather than averaged; use a mean (reduction='mean'), or scale the loss by "
                "world_size / global_batch as dpscale's Trainer does"
            )
        else:
            hint = (
                "gradients differ from the full batch by more than float rounding: look for batch-"
                "dependent layers (BatchNorm), randomness (dropout) or a loss that depends on batch size"
            )
    return Comparison(name, rel, ratio, ok, hint)


def run(
    spec: str, world_size: int = 2, accumulation_steps: int = 2, global_batch: int = 16, steps: int = 3
) -> EquivalenceResult:
    if not is_task_spec(spec):
        raise ConfigError(f"--model: {spec!r} is not {TASK_CONVENTION}")
    for flag, v in (
        ("--nproc", world_size),
        ("--accumulation-steps", accumulation_steps),
        ("--global-batch", global_batch),
        ("--steps", steps),
    ):
        if v < 1:
            raise ConfigError(f"{flag} must be >= 1, got {v}")
    for flag, parts in (("--nproc", world_size), ("--accumulation-steps", accumulation_steps)):
        if global_batch % parts:
            raise ConfigError(f"--global-batch {global_batch} must be divisible by {flag} {parts}")
    load_recipe(spec, check=True)  # fails here, once, for a task that cannot load or breaks the contract
    torch.manual_seed(0)
    initial = _flat(load_recipe(spec).build_model())
    ref = _train(spec, steps, global_batch, 1, None, 1)
    workers = run_ranks(_worker, world_size, spec, steps, global_batch, timeout_s=300)[0]
    accum = _train(spec, steps, global_batch, 1, None, accumulation_steps)
    return EquivalenceResult(
        spec,
        world_size,
        accumulation_steps,
        global_batch,
        steps,
        [
            _compare(
                f"{world_size} workers vs 1 worker", workers, ref, initial, (world_size, "1/world_size")
            ),
            _compare(
                f"{accumulation_steps} accumulation steps vs a {accumulation_steps}x batch",
                accum,
                ref,
                initial,
                (accumulation_steps, "1/accumulation_steps"),
            ),
        ],
    )


def format_result(r: EquivalenceResult) -> str:
    lines = [f"model {r.model}: global batch {r.global_batch}, {r.steps} SGD steps (lr {LR})"]
    for c in r.comparisons:
        verdict = "ok" if c.ok else "DIFFERS"
        lines.append(f"  {c.name:<45} largest relative difference {c.rel_diff:.2e}  {verdict}")
        if c.hint:
            lines.append(f"    -> {c.hint}")
    lines.append(
        f"verdict: {'equivalent' if r.ok else 'NOT equivalent'} (tolerance {REL_TOLERANCE:g} of the "
        "parameter change)"
    )
    return "\n".join(lines)


@dataclass(frozen=True, kw_only=True)
class EquivalenceCheckConfig:
    """`dpscale check equivalence`'s flags, one per field (checked by `run`)."""

    model: str = field(
        default="digits",
        metadata=flag_spec(aliases=("--workload",), help=TASK_CONVENTION),
    )
    """The model to check."""
    world_size: int = field(default=2, metadata=flag_spec(name="--nproc", deprecated=("--world-size",)))
    """Ranks of the data-parallel run."""
    accumulation_steps: int = 2
    """Micro-batches per step and rank."""
    global_batch: int = 16
    """Samples per optimizer step."""
    steps: int = 3
    """Optimizer steps compared."""
