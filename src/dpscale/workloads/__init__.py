"""Built-in models and data, all available offline."""

from .registry import WORKLOADS, Workload, get_workload

__all__ = ["WORKLOADS", "Workload", "get_workload"]
