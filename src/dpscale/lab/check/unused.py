"""`dpscale check unused`: which parameters get no gradient, and is find_unused_parameters needed?

Two dry steps (forward, loss, backward) on one process list the trainable parameters whose
gradient stays None. `find_unused_parameters=True` is needed only when some parameter is unused
in some steps; it costs an extra small all-reduce per step, so the check recommends it only then.
A parameter unused in every step is better frozen (`requires_grad_(False)`), which needs no flag.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from dpscale.errors import ConfigError
from dpscale.flags import flag_spec
from dpscale.lab.recipe import TASK_CONVENTION, is_task_spec, load_recipe


@dataclass
class UnusedResult:
    model: str
    steps: int
    unused_per_step: list[list[str]]
    recommendation: str

    @property
    def never_used(self) -> list[str]:
        sets = [set(u) for u in self.unused_per_step]
        return sorted(set.intersection(*sets)) if sets else []

    @property
    def sometimes_unused(self) -> list[str]:
        sets = [set(u) for u in self.unused_per_step]
        return sorted(set.union(*sets) - set(self.never_used)) if sets else []

    def to_dict(self) -> dict:
        return {**asdict(self), "never_used": self.never_used, "sometimes_unused": self.sometimes_unused}


def run(spec: str, steps: int = 2, batch: int = 8) -> UnusedResult:
    if not is_task_spec(spec):
        raise ConfigError(f"--model: {spec!r} is not {TASK_CONVENTION}")
    if steps < 1 or batch < 1:
        raise ConfigError("--steps and --batch must be >= 1")
    recipe = load_recipe(spec, check=True)
    torch.manual_seed(0)
    model = recipe.build_model()
    g = torch.Generator().manual_seed(0)
    unused = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        x, y = recipe.make_batch(batch, g)
        recipe.loss(recipe.forward(model, x), y).backward()
        unused.append([n for n, p in model.named_parameters() if p.requires_grad and p.grad is None])
    result = UnusedResult(spec, steps, unused, "")
    if result.sometimes_unused:
        result.recommendation = (
            "pass find_unused_parameters=True: these parameters are used in some steps "
            f"and not in others: {', '.join(result.sometimes_unused)}"
        )
    elif result.never_used:
        result.recommendation = (
            "freeze the parameters that never get a gradient (requires_grad_(False)) "
            "before wrapping; otherwise pass find_unused_parameters=True"
        )
    else:
        result.recommendation = (
            "every parameter got a gradient in every step: keep find_unused_parameters="
            "False (the flag costs an extra all-reduce per step)"
        )
    return result


def format_result(r: UnusedResult) -> str:
    lines = [f"model {r.model}: {r.steps} dry steps"]
    for i, names in enumerate(r.unused_per_step, 1):
        lines.append(
            f"  step {i}: " + (f"no gradient for {', '.join(names)}" if names else "all parameters used")
        )
    lines.append(f"recommendation: {r.recommendation}")
    return "\n".join(lines)


@dataclass(frozen=True, kw_only=True)
class UnusedCheckConfig:
    """`dpscale check unused`'s flags, one per field (checked by `run`)."""

    model: str = field(
        default="digits",
        metadata=flag_spec(help=TASK_CONVENTION),
    )
    """The model to check."""
    steps: int = 2
    """Steps to watch which parameters get gradients."""
    batch: int = 8
    """Samples per step."""
