"""Built-in models and data, all available offline."""

from dpscale.workloads.builtin import WORKLOADS, Workload, get_workload

__all__ = ["WORKLOADS", "Workload", "get_workload"]
