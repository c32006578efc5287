"""Optimizers for data parallelism: optimizer state sharded across workers (ZeRO stage 1)."""

from dpscale.optim.sharded import ShardedOptimizer, local_gradients_hook, state_bytes

__all__ = ["ShardedOptimizer", "local_gradients_hook", "state_bytes"]
