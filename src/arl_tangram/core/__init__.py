"""Pure data shared by every layer: actions, demands, allocations, outcomes, the cluster model, clocks."""

from .action import (
    API_PREFIX, CPU, GPU, MODEL_PREFIX, SANDBOX, Action, Allocation, Demand, Finished, InvalidAction, Outcome,
    pool_of,
)
from .clock import Clock, ManualClock
from .cluster import ApiQuota, Cluster, CpuNode, GpuNode, ModelSpec, scale_cluster, uniform_cluster

__all__ = [
    "API_PREFIX", "CPU", "GPU", "MODEL_PREFIX", "SANDBOX", "Action", "Allocation", "ApiQuota", "Clock", "Cluster",
    "CpuNode", "Demand", "Finished", "GpuNode", "InvalidAction", "ManualClock", "ModelSpec", "Outcome", "pool_of",
    "scale_cluster", "uniform_cluster",
]
