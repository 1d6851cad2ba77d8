"""``RayWorkerGroup``: one Ray actor per rank, placed on a ``RayResourcePool``.

Each actor is a small host (``_WorkerHost``) that builds the user's worker once its environment is set,
then runs ``execute(method, *args)`` for every call. Starting a group takes two steps: rank 0's host
finds its node IP and a free port (the rendezvous of ``torch.distributed``), then every host gets its
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and builds its worker, all at once,
since a worker may form its process group in ``__init__`` and that blocks until every rank has joined.

On a cluster of several nodes, each host logs the node it runs on, and a rank lost with its node (the
machine crashed, its raylet was killed, it left the network) is reported as ``NodeLostError``, naming the
node and the role, instead of a worker traceback.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch
from ray import cloudpickle
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridflow.protocol import DataProto
from hybridflow.single_controller.decorator import Shards
from hybridflow.single_controller.ray.resource_pool import Placement, RayResourcePool
from hybridflow.single_controller.worker import NODE_ENV, SIMULATED_RANKS_ENV, ClassWithInitArgs
from hybridflow.single_controller.worker_group import (
    NodeLostError,
    WorkerDiedError,
    WorkerError,
    WorkerGroup,
    worker_failure,
)
from hybridflow.utils.cores import CoreShare, share_cores
from hybridflow.utils.errors import UserError
from hybridflow.utils.memory import return_freed_memory

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Arguments worth storing once in the object store when several ranks get the very same object.
_SHAREABLE = (DataProto, np.ndarray, torch.Tensor)
# How long a rank that lost its connection may take to be declared lost with its node: Ray marks a node
# dead after missed health checks (about 15-30 s with its defaults); an actor merely killed is reported
# as such by Ray at once and waits for nothing.
NODE_DEATH_WAIT_S = 60.0


@dataclass(frozen=True)
class ProcessSetup:
    """How each worker process is set up before its worker is built.

    ``torch_threads``: the process takes an equal share of its node's CPUs as torch threads, shared among
    ``node_processes[node id]`` processes (every worker process of the run there: ``processes_per_node``),
    or, for a node not listed, among the group's own processes on it. Without it Ray's rule holds: one
    thread for an actor with a fraction of a CPU. Two processes that each think the node is theirs run
    twice the threads the node has, and a spinning thread pool then slows both by 2-3x (measured: an
    update beside a generating rollout on 2 cores). ``share_cores`` (with ``torch_threads``): that share is
    the start; while a call runs, the process takes the node's CPUs divided among the processes at work at
    that moment instead (``hybridflow.utils.cores``), so a trainer takes the cores of a rollout that waits.
    ``return_freed_memory``: the allocator hands freed blocks back to the OS at once
    (``hybridflow.utils.memory``)."""

    torch_threads: bool = True
    node_processes: Mapping[str, int] = field(default_factory=dict)
    share_cores: bool = True
    return_freed_memory: bool = False


class _WorkerHost:
    """The body of each Ray actor: holds one rank's worker and runs its methods by name."""

    def __init__(self) -> None:
        self._worker: Any = None
        self._cores: CoreShare | None = None

    def master_address(self) -> tuple[str, int]:
        """This node's IP and a port free right now, for rank 0 to host the process-group rendezvous."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def node(self) -> tuple[str, str]:
        """``(Ray node id, node IP)`` of this actor."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def build(
        self,
        env: dict[str, str],
        sys_path: list[str],
        cls_with_init: bytes,
        setup: ProcessSetup,
        group: str,
    ) -> None:
        """Set the rank's environment, set the process up (``setup``), construct the worker.

        The worker class arrives pickled and is loaded only after the driver's import path is added to
        ours: Ray pickles a class from an importable module by reference, and modules importable in the
        driver (a test folder put on ``sys.path`` by pytest, a project folder) are not always importable
        here."""
        sys.path.extend(path for path in sys_path if path not in sys.path)
        os.environ.update(env)
        # which machine each rank landed on, in the driver's log (Ray forwards workers' output)
        print(f"[{group} rank {env['RANK']}] on {env[NODE_ENV]}, pid {os.getpid()}", flush=True)
        if setup.torch_threads:  # Ray sets OMP_NUM_THREADS=1 for fractional-CPU actors; give each its share
            node = ray.get_runtime_context().get_node_id()
            sharing = setup.node_processes.get(node, int(env["LOCAL_WORLD_SIZE"]))
            torch.set_num_threads(max(1, usable_cpus() // sharing))
            if setup.share_cores:
                self._cores = share_cores(usable_cpus())
        if setup.return_freed_memory:
            return_freed_memory()
        with self._working():
            self._worker = cloudpickle.loads(cls_with_init)()

    def _working(self) -> contextlib.AbstractContextManager[None]:
        return self._cores.working() if self._cores is not None else contextlib.nullcontext()

    def execute(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with self._working():
            return getattr(self._worker, method)(*args, **kwargs)


_RemoteHost = ray.remote(_WorkerHost)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the OS has one, e.g. Linux; else all)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class RayWorkerGroup(WorkerGroup):
    """``resource_pool.world_size`` Ray actors, each building one worker from ``cls_with_init``.

    ``name_prefix`` names the group in errors (default: the worker class name). ``setup`` says how each
    process is set up (torch threads, allocator) before its worker is built. ``call_timeout_s`` bounds how
    long a call may wait for its answers (None: no limit; a dead actor is reported at once either way).
    ``start_timeout_s`` bounds the wait for the actors to start (importing torch in a new process can take
    a minute on a loaded 2-core machine; missing resources are reported by the pool before that).
    ``max_concurrency`` calls run at once in each actor (threads): above 1, a call can reach a worker while
    another runs (a weight update posted to a rollout that is generating).
    """

    def __init__(
        self,
        resource_pool: RayResourcePool,
        cls_with_init: ClassWithInitArgs[Any],
        name_prefix: str | None = None,
        setup: ProcessSetup = ProcessSetup(),
        call_timeout_s: float | None = None,
        start_timeout_s: float = 600.0,
        max_concurrency: int = 1,
    ) -> None:
        name = name_prefix or cls_with_init.cls.__name__
        resource_pool.acquire(name)
        try:
            backend = _RayBackend.start(
                resource_pool,
                cls_with_init,
                name,
                setup,
                call_timeout_s,
                start_timeout_s,
                max_concurrency,
            )
        except BaseException:
            resource_pool.release(name)
            raise
        self._resource_pool = resource_pool
        self._ray = backend  # the Ray actors behind the group (the base class sees a WorkerBackend)
        super().__init__(backend, cls_with_init.cls, name)

    def shutdown(self) -> None:
        """Kill the actors and free the group's share of its pool (the pool's bundles stay reserved)."""
        self._ray.kill()
        self._resource_pool.release(self.name)


class _RayBackend:
    """Submits calls to the host actors and waits for them, turning Ray's errors into ``WorkerError``."""

    def __init__(self, actors: list[Any], call_timeout_s: float | None) -> None:
        self._actors = actors
        self._call_timeout_s = call_timeout_s
        self._nodes: list[tuple[str, str]] = []  # (node id, IP) by rank, once started

    @classmethod
    def start(
        cls,
        pool: RayResourcePool,
        cls_with_init: ClassWithInitArgs[Any],
        group: str,
        setup: ProcessSetup,
        call_timeout_s: float | None,
        start_timeout_s: float,
        max_concurrency: int = 1,
    ) -> _RayBackend:
        placements = pool.placements()
        resources = pool.actor_resources()
        backend = cls(
            [
                _RemoteHost.options(
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        p.group, placement_group_bundle_index=p.bundle_index
                    ),
                    max_concurrency=max_concurrency,
                    **resources,
                ).remote()
                for p in placements
            ],
            call_timeout_s,
        )
        try:
            [(addr, port), *nodes] = backend.wait(
                [backend._actors[0].master_address.remote(), *(a.node.remote() for a in backend._actors)],
                group,
                "start (placing the actors)",
                start_timeout_s,
            )
            backend._nodes = nodes
            payload = cloudpickle.dumps(cls_with_init)
            builds = [
                actor.build.remote(
                    _rank_env(rank, p, len(placements), addr, port, describe_node(*nodes[rank])),
                    sys.path,
                    payload,
                    setup,
                    group,
                )
                for rank, (actor, p) in enumerate(zip(backend._actors, placements))
            ]
            backend.wait(builds, group, "__init__", None)
        except BaseException:
            backend.kill()
            raise
        return backend

    @property
    def world_size(self) -> int:
        return len(self._actors)

    @property
    def workers(self) -> list[Any]:
        return list(self._actors)

    def submit(self, method: str, shards: Shards, group: str, label: str) -> list[Any]:
        shards = _put_repeated(shards)
        return [
            self._actors[rank].execute.remote(method, *args, **kwargs)
            for rank, (args, kwargs) in enumerate(zip(shards.args, shards.kwargs))
        ]

    def fetch(self, handles: list[Any], group: str, label: str, timeout_s: float | None = None) -> list[Any]:
        return self.wait(handles, group, label, self._call_timeout_s if timeout_s is None else timeout_s)

    def wait(self, refs: list[Any], group: str, label: str, timeout_s: float | None) -> list[Any]:
        """Results of ``refs`` (one per rank); the first failure is raised at once, naming its rank."""
        try:
            return ray.get(refs, timeout=timeout_s)
        except GetTimeoutError:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            late = [rank for rank, ref in enumerate(refs) if ref not in ready]
            raise WorkerError(
                group, late[0], label, f"no answer within {timeout_s} s from ranks {late}"
            ) from None
        except RayError as error:
            rank, error = _first_failure(refs, error)
            died = isinstance(error, RayActorError)
            if died and rank >= 0 and self._node_lost(rank, wait=isinstance(error, ActorUnavailableError)):
                detail = _ANSI.sub("", str(error))
                raise NodeLostError(
                    describe_node(*self._nodes[rank]), group, rank, label
                ) from WorkerDiedError(group, rank, label, detail)
            kind = WorkerDiedError if died else WorkerError
            # the worker's own exception, when it is an input error (the message already holds the rest)
            cause = (
                error.cause
                if isinstance(error, RayTaskError) and isinstance(error.cause, UserError)
                else None
            )
            raised, reason = worker_failure(kind(group, rank, label, _ANSI.sub("", str(error))), cause)
            raise raised from reason

    def kill(self) -> None:
        for actor in self._actors:
            ray.kill(actor, no_restart=True)

    def _node_lost(self, rank: int, wait: bool) -> bool:
        """Whether ``rank``'s node has left the cluster. With ``wait`` (the rank's connection broke without
        Ray knowing why), give Ray up to ``NODE_DEATH_WAIT_S`` to notice a dead node."""
        if rank >= len(self._nodes):
            return False
        node_id = self._nodes[rank][0]
        deadline = time.monotonic() + (NODE_DEATH_WAIT_S if wait else 0.0)
        while True:
            alive = {node["NodeID"]: node["Alive"] for node in ray.nodes()}
            if not alive.get(node_id, False):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)


def describe_node(node_id: str, ip: str) -> str:
    """How logs and errors name a Ray node: a short id (as `ray status` lists it, ``node_<id>``) and its IP."""
    return f"node {node_id[:12]} ({ip})"


def _rank_env(
    rank: int, placement: Placement, world_size: int, master_addr: str, master_port: int, node: str
) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(placement.local_rank),
        "LOCAL_WORLD_SIZE": str(placement.local_world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        SIMULATED_RANKS_ENV: "0",
        NODE_ENV: node,
    }


def _first_failure(refs: list[Any], fallback: RayError) -> tuple[int, RayError]:
    """The lowest rank whose answer is an error (``ray.get`` of a list does not say which one failed)."""
    for rank, ref in enumerate(refs):
        if ray.wait([ref], timeout=0)[0]:
            try:
                ray.get(ref)
            except RayError as error:
                return rank, error
    return -1, fallback


def _put_repeated(shards: Shards) -> Shards:
    """Store a large argument that several ranks receive (the very same object) once in the object
    store, instead of serialising it once per rank; Ray hands each actor the stored value."""
    if len(shards) < 2:
        return shards
    counts = Counter(
        id(v) for args, kwargs in zip(shards.args, shards.kwargs) for v in (*args, *kwargs.values())
    )
    stored: dict[int, ray.ObjectRef[Any]] = {}

    def share(value: Any) -> Any:
        if counts[id(value)] < 2 or not isinstance(value, _SHAREABLE):
            return value
        if id(value) not in stored:
            stored[id(value)] = ray.put(value)
        return stored[id(value)]

    return Shards(
        [tuple(share(v) for v in args) for args in shards.args],
        [{k: share(v) for k, v in kwargs.items()} for kwargs in shards.kwargs],
        shards.pad_size,
    )
