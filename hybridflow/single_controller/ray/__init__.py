"""The Ray backend of the single controller: one actor per rank, placed on resource pools.

Only this subpackage imports Ray; driver code switches from ``LocalWorkerGroup`` to ``RayWorkerGroup``
and nothing else changes.
"""

from hybridflow.single_controller.ray.resource_pool import (
    RayResourcePool,
    ResourcePoolManager,
    free_and_total,
    processes_per_node,
    shared_cpus,
)
from hybridflow.single_controller.ray.runtime import init_ray
from hybridflow.single_controller.ray.worker_group import ProcessSetup, RayWorkerGroup

__all__ = [
    "ProcessSetup",
    "RayResourcePool",
    "RayWorkerGroup",
    "ResourcePoolManager",
    "free_and_total",
    "init_ray",
    "processes_per_node",
    "shared_cpus",
]
