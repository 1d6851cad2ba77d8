"""The single controller: one driver process calls ``worker_group.method(data)``; the call fans out to every
worker of the group and one result (usually a ``DataProto``) comes back.

This package never imports Ray: ``LocalWorkerGroup`` runs workers in the driver's process. The Ray backend
(``RayWorkerGroup``, resource pools, ``init_ray``) lives in ``hybridflow.single_controller.ray``.

May import: ``utils``, ``protocol``, ``models``, ``algorithms``, ``dataflow``, ``config``.
"""

from hybridflow.single_controller.colocate import create_colocated_worker_cls
from hybridflow.single_controller.decorator import (
    Dispatch,
    Execute,
    MethodSpec,
    Shards,
    register,
    register_dispatch_mode,
)
from hybridflow.single_controller.local import LocalWorkerGroup
from hybridflow.single_controller.roles import Role
from hybridflow.single_controller.worker import ClassWithInitArgs, Worker
from hybridflow.single_controller.worker_group import (
    NodeLostError,
    WorkerDiedError,
    WorkerError,
    WorkerFuture,
    WorkerGroup,
)

__all__ = [
    "ClassWithInitArgs",
    "Dispatch",
    "Execute",
    "LocalWorkerGroup",
    "MethodSpec",
    "NodeLostError",
    "Role",
    "Shards",
    "Worker",
    "WorkerDiedError",
    "WorkerError",
    "WorkerFuture",
    "WorkerGroup",
    "create_colocated_worker_cls",
    "register",
    "register_dispatch_mode",
]
