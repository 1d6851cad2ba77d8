"""Resource pools: where the ranks of Ray worker groups run.

A ``RayResourcePool`` reserves, per node, one placement-group bundle per process (STRICT_PACK keeps a
node's bundles on one machine). Rank ``r`` of every group built on the pool runs in bundle ``r``; up to
``max_colocate_count`` groups may share the bundles (each actor asks for that fraction of a bundle), which
is how separate groups of different roles share devices. A pool's ``resources`` (Ray custom resources, as
``ray start --resources='{"node_b": 1}'`` declares them on a node) go into every bundle, so the pool is placed
only on nodes that have them: Ray's way to pin work to machines. ``ResourcePoolManager`` maps roles to named
pools and checks that the cluster can hold them before reserving anything; ``shared_cpus`` says how many CPUs
each process can have when a machine has fewer than the processes ask for.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

# Ray counts fractional resources in ten-thousandths, and accepts a fraction only below one
RAY_RESOURCE_UNIT = 1e-4


def shared_cpus(processes: int, wanted: float, available: float) -> float:
    """CPUs per process for ``processes`` processes that each want ``wanted`` CPUs on a Ray with
    ``available`` CPUs: ``wanted`` when they all fit, else an equal share that Ray accepts (a whole number
    above one CPU, ten-thousandths below), so that a small machine runs them on shared cores instead of
    waiting for cores it does not have. 0.0 when not even one unit per process is there."""
    if processes * wanted <= available + 1e-9:
        return wanted
    share = available / processes
    if share >= 1:
        return float(math.floor(share))
    return math.floor(share / RAY_RESOURCE_UNIT + 1e-9) * RAY_RESOURCE_UNIT


def free_and_total(kind: str, at_least: float = 0.0, wait_s: float = 0.0) -> tuple[float, float]:
    """How much of resource ``kind`` (``"CPU"``, ``"GPU"``) the running Ray cluster has free, and in all;
    waits up to ``wait_s`` seconds for ``at_least`` to be free (Ray takes back a stopped worker's resources
    a moment after it stops)."""
    deadline = time.monotonic() + wait_s
    while True:
        free, total = ray.available_resources().get(kind, 0.0), ray.cluster_resources().get(kind, 0.0)
        if free + 1e-9 >= min(at_least, total) or time.monotonic() >= deadline:
            return free, total
        time.sleep(0.1)


def processes_per_node(pools: Iterable[RayResourcePool]) -> dict[str, int]:
    """Ray node id -> how many worker processes ``pools`` place there (each bundle holds up to
    ``max_colocate_count`` of them): the processes that share that node's CPUs."""
    counts: Counter[str] = Counter()
    for pool in pools:
        for node in pool.bundle_nodes():
            counts[node] += pool.max_colocate_count
    return dict(counts)


@dataclass(frozen=True)
class Placement:
    """Where one rank runs: bundle ``bundle_index`` of ``group``, the ``local_rank``-th process of the
    pool on node ``node_index``, which holds ``local_world_size`` processes."""

    group: PlacementGroup
    bundle_index: int
    node_index: int
    local_rank: int
    local_world_size: int


class RayResourcePool:
    """``process_on_nodes[i]`` processes on node ``i``; each process gets a bundle of ``cpus_per_process``
    CPUs (and one GPU when ``use_gpu``, and ``resources``, e.g. ``{"node_b": 0.01}``, to pin it to the nodes
    that declare them). Placement groups are reserved on first use."""

    def __init__(
        self,
        process_on_nodes: list[int],
        use_gpu: bool = False,
        max_colocate_count: int = 1,
        cpus_per_process: float = 1.0,
        name: str = "pool",
        ready_timeout_s: float = 60.0,
        resources: Mapping[str, float] | None = None,
    ) -> None:
        if not process_on_nodes or any(n < 1 for n in process_on_nodes):
            raise ValueError(
                f"process_on_nodes must list at least one node, each with >= 1 process; "
                f"got {process_on_nodes}"
            )
        if max_colocate_count < 1 or cpus_per_process <= 0:
            raise ValueError(
                f"max_colocate_count must be >= 1 and cpus_per_process > 0; got {max_colocate_count}"
                f" and {cpus_per_process}"
            )
        resources = dict(resources or {})
        if any(not isinstance(v, (int, float)) or v <= 0 for v in resources.values()):
            raise ValueError(f"resources of pool {name!r} must be positive amounts, got {resources}")
        self.resources = resources
        self.process_on_nodes = list(process_on_nodes)
        self.use_gpu = use_gpu
        self.max_colocate_count = max_colocate_count
        self.cpus_per_process = cpus_per_process
        self.name = name
        self.ready_timeout_s = ready_timeout_s
        self._groups: list[PlacementGroup] = []
        self._users: list[str] = []

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    def required_resources(self) -> dict[str, float]:
        """What reserving this pool takes from the cluster."""
        needed = {"CPU": self.world_size * self.cpus_per_process}
        if self.use_gpu:
            needed["GPU"] = float(self.world_size)
        for key, amount in self.resources.items():
            needed[key] = needed.get(key, 0.0) + amount * self.world_size
        return needed

    def actor_resources(self) -> dict[str, float]:
        """``num_cpus`` / ``num_gpus`` of one actor: an equal share of its bundle among colocated groups."""
        share = 1.0 / self.max_colocate_count
        return {"num_cpus": self.cpus_per_process * share, "num_gpus": share if self.use_gpu else 0.0}

    def placements(self) -> list[Placement]:
        """One ``Placement`` per rank, ranks numbered node by node."""
        return [
            Placement(group, local_rank, node, local_rank, count)
            for node, (group, count) in enumerate(zip(self._placement_groups(), self.process_on_nodes))
            for local_rank in range(count)
        ]

    def bundle_nodes(self) -> list[str]:
        """The Ray node id of each rank's bundle (ranks numbered as in ``placements``)."""
        tables = {
            id(group): placement_group_table(group)["bundles_to_node_id"]
            for group in self._placement_groups()
        }
        return [tables[id(p.group)][p.bundle_index] for p in self.placements()]

    def acquire(self, user: str) -> None:
        """Count one more worker group on the pool; refuse beyond ``max_colocate_count`` (its actors would
        wait forever for a share of the bundles)."""
        if len(self._users) >= self.max_colocate_count:
            raise RuntimeError(
                f"resource pool {self.name!r} already holds {self._users} (max_colocate_count="
                f"{self.max_colocate_count}); cannot add worker group {user!r}: raise "
                "max_colocate_count or colocate the roles in one group"
            )
        self._users.append(user)

    def release(self, user: str) -> None:
        self._users.remove(user)

    def remove(self) -> None:
        """Give the reserved bundles back to the cluster (the pool's groups must be shut down first)."""
        for group in self._groups:
            remove_placement_group(group)
        self._groups = []

    def _placement_groups(self) -> list[PlacementGroup]:
        if not self._groups:
            bundle = {
                "CPU": self.cpus_per_process,
                **({"GPU": 1.0} if self.use_gpu else {}),
                **self.resources,
            }
            for node, count in enumerate(self.process_on_nodes):
                group = placement_group(
                    [dict(bundle) for _ in range(count)],
                    strategy="STRICT_PACK",
                    name=f"{self.name}:{node}:{id(self):x}",
                )
                self._groups.append(group)
                if not group.wait(self.ready_timeout_s):
                    self.remove()
                    raise RuntimeError(
                        f"resource pool {self.name!r}: node {node} needs {count} bundles of {bundle} on one "
                        f"machine, not placed within {self.ready_timeout_s:.0f} s; the cluster has "
                        f"{_rounded(ray.available_resources())} available"
                    )
        return self._groups


class ResourcePoolManager:
    """Named pools and which role runs on which.

    ``resource_pool_spec``: pool name -> processes per node, e.g. ``{"global": [2]}``; ``mapping``: role (a
    string or ``Role``) -> pool name. Each pool admits as many colocated groups as roles map to it, unless
    ``max_colocate_count`` says otherwise. ``pool_resources``: pool name -> custom resources of each of its
    processes (pins the pool to the nodes that declare them).
    """

    def __init__(
        self,
        resource_pool_spec: Mapping[str, list[int]],
        mapping: Mapping[str | Enum, str],
        use_gpu: bool = False,
        cpus_per_process: float = 1.0,
        max_colocate_count: int | None = None,
        pool_resources: Mapping[str, Mapping[str, float]] | None = None,
    ) -> None:
        unknown = {str(role): pool for role, pool in mapping.items() if pool not in resource_pool_spec}
        if unknown:
            raise KeyError(
                f"roles map to undefined pools {unknown}; defined pools: {sorted(resource_pool_spec)}"
            )
        self.resource_pool_spec = {name: list(nodes) for name, nodes in resource_pool_spec.items()}
        self.mapping = dict(mapping)
        self.use_gpu = use_gpu
        self.cpus_per_process = cpus_per_process
        self.max_colocate_count = max_colocate_count
        self.pool_resources = {name: dict(res) for name, res in (pool_resources or {}).items()}
        self.pools: dict[str, RayResourcePool] = {}

    def create_resource_pool(self) -> dict[str, RayResourcePool]:
        """Check the cluster has room for every pool, then reserve them; returns pools by name."""
        pools = {}
        for name, nodes in self.resource_pool_spec.items():
            roles = sum(1 for pool in self.mapping.values() if pool == name)
            pools[name] = RayResourcePool(
                nodes,
                use_gpu=self.use_gpu,
                cpus_per_process=self.cpus_per_process,
                max_colocate_count=self.max_colocate_count or max(1, roles),
                name=name,
                resources=self.pool_resources.get(name),
            )
        self.check_resources(pools)
        for pool in pools.values():
            pool.placements()
        self.pools = pools
        return pools

    def get_resource_pool(self, role: str | Enum) -> RayResourcePool:
        if not self.pools:
            raise RuntimeError("call create_resource_pool() before get_resource_pool()")
        if role not in self.mapping:
            raise KeyError(
                f"role {str(role)!r} has no resource pool; mapped roles: {[str(r) for r in self.mapping]}"
            )
        return self.pools[self.mapping[role]]

    @staticmethod
    def check_resources(pools: Mapping[str, RayResourcePool]) -> None:
        """Raise naming each missing resource (needed vs available) when the pools cannot all fit."""
        needed: dict[str, float] = {}
        for pool in pools.values():
            for key, amount in pool.required_resources().items():
                needed[key] = needed.get(key, 0.0) + amount
        available = ray.available_resources()
        missing = {
            key: (amount, available.get(key, 0.0))
            for key, amount in needed.items()
            if amount > available.get(key, 0.0) + 1e-9
        }
        if missing:
            detail = "; ".join(
                f"{key}: need {need:g}, available {have:g}" for key, (need, have) in missing.items()
            )
            spec = {name: pool.process_on_nodes for name, pool in pools.items()}
            raise RuntimeError(f"the Ray cluster cannot hold resource pools {spec}: {detail}")


def _rounded(resources: Mapping[str, float]) -> dict[str, float]:
    return {key: round(value, 2) for key, value in resources.items() if not key.startswith("node:")}
