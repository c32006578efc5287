"""Where a worker computes and in which precision: its device, the process group backend, autocast
and the fp16 loss scaler.

On CUDA each worker takes the GPU of its LOCAL_RANK (what torchrun and the elastic agent set),
modulo the GPUs it sees, and the process group is NCCL; on CPU it is gloo. Mixed precision is
autocast around forward and loss; fp16 also needs loss scaling, whose skip-and-back-off decision
must be the same on every rank, so it follows the trainer's collective skip decision rather than
each rank's own overflow check.
"""

from __future__ import annotations

import contextlib
import os

import torch

from dpscale.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str, local_rank: int | None = None) -> torch.device:
    """`auto`: this worker's GPU when CUDA is available, else the CPU; ValueError for cuda without one."""
    if name not in DEVICES:
        raise ConfigError(f"device: unknown {name!r}; choose one of {', '.join(DEVICES)}")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("device cuda: no CUDA device is visible to this process; use --device cpu or auto")
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    # modulo: where each task sees only its own GPUs (SLURM's --gpus-per-task=1, a per-rank
    # CUDA_VISIBLE_DEVICES) local rank 3 has GPU 0; with all of a host's GPUs visible it is the same
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def check_gpu_count(name: str, workers_per_host: int) -> None:
    """ConfigError when `workers_per_host` workers started here would share a GPU (NCCL refuses
    two ranks on one device): the launcher's view, with all of the host's GPUs visible."""
    device = resolve_device(name, local_rank=0)
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda" and workers_per_host > count:
        raise ConfigError(
            f"device cuda: {workers_per_host} workers on this host need {workers_per_host} GPUs but only "
            f"{count} are visible; use --nproc {count} or fewer"
        )


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def device_id_for(device: torch.device) -> torch.device | None:
    """init_process_group's `device_id`: the GPU on CUDA (NCCL then binds its communicator to it,
    and barrier and object collectives use it rather than guessing one from the rank), else None."""
    return device if device.type == "cuda" else None


class Precision:
    """autocast for forward and loss, plus a GradScaler for fp16 kept in lockstep across ranks."""

    def __init__(self, name: str, device: torch.device):
        if name not in PRECISIONS:
            raise ConfigError(f"precision: unknown {name!r}; choose one of {', '.join(PRECISIONS)}")
        self.name = name
        self.device = device
        self.scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None

    def autocast(self):
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=_DTYPES[self.name])

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler else loss

    def loss_scale(self) -> torch.Tensor | float:
        """What the gradients are multiplied by until `unscale`: 1 without fp16; with it a 0-d
        tensor on the device (`GradScaler.get_scale()` would wait for the device to read it)."""
        if self.scaler is None:
            return 1.0
        return self.scaler.scale(torch.ones((), device=self.device))

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the (reduced) gradients by the loss scale before they are measured or clipped."""
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, skipped: bool) -> None:
        """Apply the step unless the ranks decided together to skip it; move the scale the same way
        everywhere. After the reduction every rank holds the same gradients, so a rank's own
        overflow check agrees with the collective decision; the backed-off scale is set explicitly
        on a skip anyway, so the scale can never differ between ranks. The collective decision is
        the overflow check: `GradScaler.step` would read its own again (a host sync) to learn what
        the ranks already agreed (the gradients were unscaled by `unscale` before)."""
        if self.scaler is None:
            if not skipped:
                optimizer.step()
            return
        if skipped:
            self.scaler.update(self.loss_scale() * self.scaler.get_backoff_factor())
        else:
            optimizer.step()
            self.scaler.update()

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)
