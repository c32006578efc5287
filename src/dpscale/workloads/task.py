"""`dpscale.Task`: the user's model, data, loss and metrics, the one contract every command takes.

A Task says *what* to train; `TrainConfig` says *how* (batch, optimizer defaults, devices). The
loss returns one value per sample so the trainer can divide the sum by the global sample count
itself: a mean over a micro-batch would weight samples unequally when micro-batches differ in
size (a short last batch) and would hide the factor W x k that data parallelism must undo.
Everything here runs on one process; the trainer and the lab decide how batches are split.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sized
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, default_collate

from dpscale.errors import ConfigError, UserCodeError

PER_SAMPLE_HINT = 'return one value per sample, shape [batch], e.g. F.cross_entropy(out, y, reduction="none")'


@dataclass(frozen=True)
class Task:
    """A model factory, map-style datasets of `(input, target)` items, a per-sample loss, metrics.

    - `model`: called with no arguments (a class works) on every rank after seeding with the
      run's seed; the engine then copies rank 0's weights to every rank.
    - `train_data` / `eval_data`: map-style datasets; `input` may be a tensor (`model(x)`), a
      tuple (`model(*x)`) or a dict (`model(**x)`). Batched by `collate_fn`, else `default_collate`.
    - `loss(output, target)`: per-sample losses, shape [batch].
    - `metrics`: name -> `fn(output, target)` giving per-sample values; evaluation reports their
      mean over `eval_data` (with the loss's, as "loss").
    - `optimizer`: optional `params -> torch.optim.Optimizer`; otherwise the config's optimizer
      (`dpscale train` refuses the config's optimizer flags beside it: they would not apply).
    """

    model: Callable[[], nn.Module]
    train_data: Dataset
    eval_data: Dataset | None = None
    loss: Callable[[Any, Any], torch.Tensor] | None = None
    metrics: Mapping[str, Callable[[Any, Any], torch.Tensor]] = field(default_factory=dict)
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None
    collate_fn: Callable[[list], Any] | None = None

    def __post_init__(self) -> None:
        if not callable(self.model) or isinstance(self.model, nn.Module):
            raise ConfigError(
                "Task.model must be a callable that builds the model (a class or a function), "
                f"not {type(self.model).__name__}; e.g. Task(model=MyNet, ...)"
            )
        _check_dataset("train_data", self.train_data)
        if self.eval_data is not None:
            _check_dataset("eval_data", self.eval_data)
        if self.loss is None or not callable(self.loss):
            raise ConfigError(
                f"Task.loss must be a function loss(output, target) that would {PER_SAMPLE_HINT}"
            )
        if not isinstance(self.metrics, Mapping):
            raise ConfigError("Task.metrics must be a dict of name -> fn(output, target)")
        for name, fn in self.metrics.items():
            if not isinstance(name, str) or not name or name == "loss" or not callable(fn):
                raise ConfigError(
                    f"Task.metrics: {name!r} must map a name other than 'loss' to fn(output, target)"
                )
        for name in ("optimizer", "collate_fn"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise ConfigError(f"Task.{name} must be callable or None")

    def collate(self, items: list) -> Any:
        return (self.collate_fn or default_collate)(items)

    def per_sample_loss(self, output: Any, target: Any) -> torch.Tensor:
        """`loss(output, target)` (the field is optional only in the signature: it is checked above)."""
        assert self.loss is not None
        return self.loss(output, target)


def num_samples(data: Dataset) -> int:
    """`len(data)` of a map-style dataset (a Task's datasets are checked to have one)."""
    assert isinstance(data, Sized)
    return len(data)


def _check_dataset(name: str, data: Any) -> None:
    if isinstance(data, IterableDataset) or not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        raise ConfigError(
            f"Task.{name} must be a map-style dataset (with __len__ and __getitem__ returning "
            f"(input, target)), not {type(data).__name__}; e.g. torch.utils.data.TensorDataset(x, y)"
        )
    if len(data) < 1:
        raise ConfigError(f"Task.{name} is empty; give it at least one (input, target) item")


def call_model(model: nn.Module, inputs: Any) -> Any:
    """`model(x)`, `model(*x)` or `model(**x)` by the input's kind."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in a nest of tuples, lists and dicts to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    return batch


def per_sample(what: str, values: Any, batch: int) -> torch.Tensor:
    """`values` as a float tensor of shape [batch]; a one-line ValueError naming the fix otherwise."""
    if not isinstance(values, torch.Tensor):
        raise ConfigError(f"{what} returned {type(values).__name__}, not a tensor; {PER_SAMPLE_HINT}")
    if values.dim() == 0:
        raise ConfigError(
            f"{what} returned a scalar; dpscale needs per-sample values to weight samples exactly "
            f'across workers: pass reduction="none" (shape [{batch}])'
        )
    if tuple(values.shape) != (batch,):
        raise ConfigError(
            f"{what} returned shape {list(values.shape)} for {batch} samples; {PER_SAMPLE_HINT}"
        )
    return values


def split_item(item: Any, where: str) -> tuple[Any, Any]:
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise ConfigError(f"{where} items must be (input, target) pairs, got {type(item).__name__}")
    return item[0], item[1]


def probe(task: Task, samples: int = 2) -> None:
    """Build the model and run a few items of each dataset through it, loss and metrics: every
    contract violation surfaces here as one ValueError, before any worker starts; a raise or
    sys.exit in the user's code as a UserCodeError naming the call (`Task.model()`, `forward`)."""
    model = user_call("Task.model()", task.model)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"Task.model() returned {type(model).__name__}; it must return a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(
            f"Task.model() built a {type(model).__name__} with no trainable parameters: there is "
            "nothing to train or to synchronize; give the model at least one nn.Parameter that requires grad"
        )
    for name in ("train_data", "eval_data"):
        if getattr(task, name) is not None:
            _probe_data(task, model, name, samples)


def _probe_data(task: Task, model: nn.Module, name: str, samples: int) -> None:
    data = getattr(task, name)
    n = min(samples, len(data))
    items = [user_call(f"Task.{name}[{i}]", functools.partial(data.__getitem__, i)) for i in range(n)]
    for item in items:
        split_item(item, f"Task.{name}")
    x, y = user_call(
        "Task.collate_fn" if task.collate_fn else f"collating Task.{name}", lambda: task.collate(items)
    )
    model.eval()  # BatchNorm refuses a batch of one in training mode
    with torch.no_grad():
        out = user_call(f"forward of Task.model() on {name}", lambda: call_model(model, x))
        if not _holds_tensor(out):
            raise ConfigError(
                f"forward of Task.model() on {name} returned {type(out).__name__}, which holds no "
                "tensor; return the model's output as a tensor (or a tuple or dict of tensors)"
            )
        loss = user_call("Task.loss", lambda: task.per_sample_loss(out, y))
        per_sample(f"Task.loss on {name}", loss, n)
        for metric, fn in task.metrics.items():
            value = user_call(f"Task.metrics[{metric!r}]", functools.partial(fn, out, y))
            per_sample(f"Task.metrics[{metric!r}]", value, n)


def user_call(what: str, fn: Callable[[], Any]) -> Any:
    """`fn()`, which runs the user's code: a ConfigError (a check of ours inside it) passes, and any
    other raise, or sys.exit, becomes a UserCodeError naming `what` with the user's frames."""
    try:
        return fn()
    except ConfigError:
        raise
    except (Exception, SystemExit) as e:
        raise UserCodeError.from_exception(what, e) from None


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return any(_holds_tensor(v) for v in value)
    return hasattr(value, "__dataclass_fields__") or hasattr(value, "to_tuple")  # ModelOutput-like
