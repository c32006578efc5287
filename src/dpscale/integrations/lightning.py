"""Lightning: `Trainer(strategy="dpscale")` trains with dpscale's engine instead of torch's DDP.

    import dpscale.integrations.lightning  # registers the "dpscale" strategy
    trainer = lightning.Trainer(strategy="dpscale", accelerator="cpu", devices=2)

`DPScaleStrategy` is Lightning's `DDPStrategy` with one change of engine, so everything Lightning
does around DDP (launching, gradient accumulation through `no_sync`, manual optimization, saving
the unwrapped module) works unchanged: dpscale's engine is a `DistributedDataParallel` to
Lightning's isinstance checks. Two differences from `DDPStrategy`: a comm hook (`ddp_comm_hook=`)
is registered on CPU too (Lightning registers one on CUDA only), and teardown closes the engine
(its shared-memory buffers go back at once). dpscale's own engine options (`transport`,
`first_bucket_cap_mb`, `collective_timeout_s`) are accepted next to DDP's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from dpscale.engine import DistributedDataParallel

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

_ENGINE_OPTIONS = ("transport", "first_bucket_cap_mb", "collective_timeout_s")


class DPScaleStrategy(DDPStrategy):
    strategy_name = "dpscale"

    def __init__(self, **kwargs: Any) -> None:
        engine = {k: kwargs.pop(k) for k in _ENGINE_OPTIONS if k in kwargs}
        super().__init__(**kwargs)
        self._engine_kwargs = engine

    def _setup_model(self, model):
        device_ids = self.determine_ddp_device_ids()
        return DistributedDataParallel(
            model, device_ids=device_ids, **self._ddp_kwargs, **self._engine_kwargs
        )

    def _register_ddp_hooks(self) -> None:
        if self._ddp_comm_hook is not None or self._ddp_comm_wrapper is not None:
            _register_ddp_comm_hook(
                # dpscale's engine has the comm-hook surface of torch's DDP that this call uses
                model=cast("TorchDDP", self.model),
                ddp_comm_state=self._ddp_comm_state,
                ddp_comm_hook=self._ddp_comm_hook,
                ddp_comm_wrapper=self._ddp_comm_wrapper,
            )

    def teardown(self) -> None:
        engine = self.model if isinstance(self.model, DistributedDataParallel) else None
        super().teardown()
        if engine is not None:
            engine.close()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="DDP with dpscale's engine", override=True
        )


if DPScaleStrategy.strategy_name not in StrategyRegistry:
    DPScaleStrategy.register_strategies(StrategyRegistry)
