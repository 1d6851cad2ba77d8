"""Building the worker groups a PPO run needs, on the local or the Ray backend.

Where each role runs is a placement (``trainer.placement``, verl's resource-pool spec): named pools of
worker processes, and a mapping from role to pool. The roles that share a pool are colocated in one process
per rank (the hybrid engine: the roles share the devices instead of each taking its own), then split back
into one group view per role. ``colocated`` puts every role in one pool; ``split`` gives the actor (with the
reference and the critic), the rollout and the reward their own pools, so a separate rollout worker must be
sent the actor's weights after each update (``PPOTrainer.sync_rollout_weights``).

Only the backend differs between a laptop and a cluster: a ``LocalWorkerGroup`` of one rank in the driver's
process (colocated only), or ``RayWorkerGroup`` s with the pools' processes. Every worker runs on
``trainer.device``.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from hybridflow.config import PPOConfig, TrainerConfig
from hybridflow.config.checks import ConfigError
from hybridflow.config.offline import OfflineConfig
from hybridflow.rollout import RolloutEngine, rollout_class
from hybridflow.single_controller import (
    ClassWithInitArgs,
    LocalWorkerGroup,
    Role,
    WorkerGroup,
    create_colocated_worker_cls,
)
from hybridflow.trainer.shaping import teacher_worker_config
from hybridflow.utils.errors import UserError
from hybridflow.utils.memory import return_freed_memory
from hybridflow.workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker, RewardWorker

logger = logging.getLogger(__name__)

# Written by the driver into the run folder before the first checkpoint, read back by every worker.
SHARED_MARKER = ".hybridflow-shared-check"

# The roles a placement maps to pools. "actor" and "rollout" in one pool form the hybrid engine's
# actor_rollout worker; "reward" is the reward function's worker (without it, the driver scores).
PLACEMENT_ROLES = ("actor", "rollout", "ref", "critic", "reward_model", "reward", "teacher")


@dataclass
class WorkerGroups:
    """One group per role; ``None`` for a role the run does not use. ``rollout`` is set only when the
    rollout runs apart from the actor (else ``actor_rollout`` generates); ``reward`` only when the reward
    function runs in a worker (else the driver calls it)."""

    actor_rollout: WorkerGroup
    ref: WorkerGroup | None = None
    critic: WorkerGroup | None = None
    reward_model: WorkerGroup | None = None
    rollout: WorkerGroup | None = None
    reward: WorkerGroup | None = None
    teacher: WorkerGroup | None = None  # on-policy distillation's teacher (actor_rollout_ref.teacher)
    release: Callable[[], None] | None = None  # frees what building the groups took (Ray actors, CPUs)

    @property
    def generator(self) -> WorkerGroup:
        """The group that generates: the separate rollout, or the hybrid engine's actor_rollout."""
        return self.rollout or self.actor_rollout

    def check_shared_folder(self, folder: str | os.PathLike) -> None:
        """Raise ``UserError`` when a worker does not see ``folder`` as the driver does.

        Workers write their checkpoint files (model shards, optimizer state, the Hugging Face folder) into
        the run folder themselves; on a node that mounts another filesystem there, they would land on that
        node's disk, and the checkpoint the driver then seals would be incomplete. So the driver writes a
        marker with a fresh token and every worker process reads it back before the first save."""
        marker = Path(folder) / SHARED_MARKER
        marker.parent.mkdir(parents=True, exist_ok=True)
        token = f"{os.getpid()}-{uuid.uuid4().hex}"
        marker.write_text(token)
        try:
            seen: set[tuple[int, ...]] = set()
            for f in fields(self):
                group = getattr(self, f.name)
                if not isinstance(group, WorkerGroup) or tuple(map(id, group.workers)) in seen:
                    continue
                seen.add(tuple(map(id, group.workers)))
                for rank, text in enumerate(group.execute_all("peek_file", str(marker))):
                    if text != token:
                        node = group.execute_all("node")[rank]
                        raise UserError(
                            f"the run folder {folder} is not shared with {node}: rank {rank} of worker group "
                            f"{group.name!r} cannot read the marker the driver just wrote there. Workers "
                            "write checkpoints into the run folder, so trainer.default_local_dir must be on "
                            "a filesystem every node mounts at the same path (NFS, a cluster filesystem); "
                            "nothing was saved"
                        )
        finally:
            marker.unlink(missing_ok=True)

    def shutdown(self) -> None:
        """Stop the workers and give their resources back; the groups are unusable afterwards."""
        if self.release is not None:
            self.release()
            self.release = None


def needs_ref(config: PPOConfig) -> bool:
    """A reference policy is only loaded when a KL term (in the loss or in the reward) uses it."""
    return bool(config.actor_rollout_ref.actor.use_kl_loss or config.algorithm.use_kl_in_reward)


def placement(tr: TrainerConfig) -> tuple[dict[str, list[int]], dict[str, str]]:
    """``(pools, role -> pool)`` for ``trainer.placement``, with ``resource_pool_spec`` and ``role_pools``
    laid over the preset; every role maps to a defined pool."""
    if tr.placement == "split":
        pools = {"actor": [tr.n_workers], "rollout": [1], "reward": [1]}
        roles = {
            "actor": "actor",
            "ref": "actor",
            "teacher": "actor",
            "critic": "actor",
            "rollout": "rollout",
            "reward": "reward",
            "reward_model": "reward",
        }
    else:
        pools = {"global": [tr.n_workers]}
        roles = {role: "global" for role in PLACEMENT_ROLES if role != "reward"}
    pools.update(
        {
            name: list(nodes) if isinstance(nodes, list) else [nodes]
            for name, nodes in tr.resource_pool_spec.items()
        }
    )
    roles.update(tr.role_pools)
    unknown = sorted(set(roles) - set(PLACEMENT_ROLES))
    if unknown:
        raise ConfigError(f"trainer.role_pools: unknown role(s) {unknown}; roles are {list(PLACEMENT_ROLES)}")
    undefined = {role: pool for role, pool in roles.items() if pool not in pools}
    if undefined:
        raise ConfigError(
            f"trainer.role_pools maps {undefined} to undefined pools; trainer.resource_pool_spec "
            f"defines {sorted(pools)}"
        )
    bad = {
        name: nodes
        for name, nodes in pools.items()
        if not nodes or not all(isinstance(n, int) and n >= 1 for n in nodes)
    }
    if bad:
        raise ConfigError(
            f"trainer.resource_pool_spec: each pool lists processes per node (integers >= 1), got {bad}"
        )
    return pools, roles


def pool_resources(trainer: TrainerConfig, pools: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    """``trainer.pool_resources`` checked against the pools: pool name -> {custom resource: amount per
    process}. Ray places a pool only on nodes that declare its resources, which pins it to machines."""
    given = trainer.pool_resources
    undefined = sorted(set(given) - set(pools))
    if undefined:
        raise ConfigError(
            f"trainer.pool_resources names undefined pool(s) {undefined}; the placement defines {sorted(pools)}"
        )
    bad = {
        name: res
        for name, res in given.items()
        if not isinstance(res, dict)
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in res.values())
    }
    if bad:
        raise ConfigError(
            "trainer.pool_resources: each pool maps custom resource names to positive amounts per process "
            f"(e.g. {{rollout: {{node_b: 0.01}}}}), got {bad}"
        )
    return {name: {key: float(v) for key, v in res.items()} for name, res in given.items()}


def rollout_engine(config: PPOConfig) -> type[RolloutEngine]:
    """The engine class ``rollout.name`` registers, checked on the driver before any worker starts: a
    registered name, and an engine that follows weights when a partial rollout will ask it to."""
    engine = rollout_class(config.actor_rollout_ref.rollout.name)
    run = config.async_training
    if run.mode == "fully_async" and run.partial_rollout and not engine.capabilities.follows_weights:
        raise ConfigError(
            "async_training.partial_rollout=true swaps weights between decoding steps, which the rollout "
            f"engine {config.actor_rollout_ref.rollout.name!r} does not declare (Capabilities.follows_weights): "
            "set async_training.partial_rollout=false"
        )
    return engine


def role_inits(
    config: PPOConfig, roles: dict[str, str] | None = None, reward_fn: Callable[..., dict] | None = None
) -> dict[str, ClassWithInitArgs]:
    """The deferred constructor of each role's worker, keyed by the role's group name. With ``roles`` (a
    placement's role -> pool), an actor and rollout in different pools become two workers, and
    ``reward_fn`` a ``RewardWorker`` where the placement maps ``reward``."""
    roles = roles or {}
    arr = config.actor_rollout_ref
    device = config.trainer.device
    kw = {
        "response_length": config.data.max_response_length,
        "seed": config.trainer.seed,
        "device": device,
        "sandbox": config.sandbox,
    }
    # the engine class, checked here on the driver, goes to whichever worker holds the rollout role, and to a
    # split actor (what the engine declares decides which weights it sends: LoRA adapters alone or merged)
    rollout_kw = {"rollout_engine": rollout_engine(config)}
    # With LoRA the reference is the actor's module with the adapter off: the actor worker takes the role
    ref_in_actor = needs_ref(config) and arr.model.lora_rank > 0
    with_ref = "_ref" if ref_in_actor else ""
    inits: dict[str, ClassWithInitArgs[Any]]
    if roles.get("actor") == roles.get("rollout"):
        inits = {
            str(Role.ACTOR_ROLLOUT): ClassWithInitArgs(
                ActorRolloutRefWorker, arr, role=f"actor_rollout{with_ref}", **kw, **rollout_kw
            )
        }
    else:
        inits = {
            "actor": ClassWithInitArgs(
                ActorRolloutRefWorker, arr, role=f"actor{with_ref}", **kw, **rollout_kw
            ),
            "rollout": ClassWithInitArgs(
                ActorRolloutRefWorker, arr, role="rollout", announce=True, **kw, **rollout_kw
            ),
        }
    if needs_ref(config) and not ref_in_actor:
        inits[str(Role.REF)] = ClassWithInitArgs(ActorRolloutRefWorker, arr, role="ref", **kw)
    if arr.teacher.path:  # a frozen worker like the reference, loading the teacher's model
        inits["teacher"] = ClassWithInitArgs(
            ActorRolloutRefWorker, teacher_worker_config(arr), role="ref", **kw
        )
    if config.critic.enable:
        inits[str(Role.CRITIC)] = ClassWithInitArgs(
            CriticWorker, config.critic, rollout_n=arr.rollout.n, seed=config.trainer.seed, device=device
        )
    if config.reward_model.enable:
        inits[str(Role.REWARD_MODEL)] = ClassWithInitArgs(
            RewardModelWorker, config.reward_model, policy_tokenizer_path=arr.model.path, device=device
        )
    if reward_fn is not None and "reward" in roles:
        inits["reward"] = ClassWithInitArgs(RewardWorker, reward_fn)
    return inits


# Ray returns the resources of stopped workers a moment after they stop: how long to wait for them
RELEASE_WAIT_S = 15.0


def ray_cpus_per_worker(trainer: TrainerConfig, processes: int) -> float:
    """CPUs each of ``processes`` Ray worker processes reserves: ``trainer.cpus_per_worker``, or, on a Ray
    with fewer CPUs than they ask for together, an equal share of its CPUs (a laptop user who asks for split
    placement gets it on shared cores; one log line says so). On cuda each process also takes a GPU of its
    own. Refused up front (else the placement would wait a minute, then fail with Ray's resource message):
    what can never be placed, a Ray with fewer GPUs than processes or without CPUs, and what other Ray work
    holds the resources for."""
    from hybridflow.single_controller.ray import free_and_total, shared_cpus

    who = f"trainer.n_workers={trainer.n_workers} with trainer.placement={trainer.placement}"
    if trainer.device == "cuda":
        free_gpus, total_gpus = free_and_total("GPU", at_least=processes, wait_s=RELEASE_WAIT_S)
        if processes > free_gpus + 1e-9:
            raise UserError(
                f"{who} starts {processes} worker processes, each needing a GPU of its own, but Ray sees "
                f"{free_gpus:g} GPUs available (of {total_gpus:g}): lower trainer.n_workers, use "
                "trainer.placement=colocated, or give Ray more GPUs"
            )
    wanted = trainer.cpus_per_worker
    share = shared_cpus(processes, wanted, free_and_total("CPU")[1])
    free, total = free_and_total("CPU", at_least=processes * share, wait_s=RELEASE_WAIT_S)
    if share <= 0 or processes * share > free + 1e-9:
        held = "" if share <= 0 else f"; other Ray work holds {total - free:g}"
        raise UserError(
            f"{who} starts {processes} worker processes, but Ray sees {free:g} CPUs available (of "
            f"{total:g}){held}: stop that work, or give Ray CPUs (trainer.ray_kwargs.num_cpus=...)"
        )
    if share < wanted:
        logger.warning(
            "%d worker processes x trainer.cpus_per_worker=%g ask %g CPUs, Ray has %g: they share them, "
            "%g CPUs each",
            processes,
            wanted,
            processes * wanted,
            total,
            share,
        )
    return share


def check_pool_resources(extra: dict[str, dict[str, float]], pools: dict[str, list[int]]) -> None:
    """Refuse up front a pool pinned to custom resources that no live node of the cluster has enough of."""
    import ray

    available, total = ray.available_resources(), ray.cluster_resources()
    for pool, resources in extra.items():
        for key, amount in resources.items():
            needed = amount * sum(pools[pool])
            if needed > available.get(key, 0.0) + 1e-9:
                raise UserError(
                    f"trainer.pool_resources.{pool} asks for {needed:g} of resource {key!r}, but Ray sees "
                    f"{available.get(key, 0.0):g} available (of {total.get(key, 0.0):g}): start a node with "
                    f"`ray start --resources='{{\"{key}\": 1}}'`, or pin the pool elsewhere"
                )


def build_worker_groups(
    config: PPOConfig | OfflineConfig,
    reward_fn: Callable[..., dict] | None = None,
    inits: dict[Any, ClassWithInitArgs] | None = None,
    overlapping: bool = False,
) -> WorkerGroups:
    """Start the workers (``trainer.backend``: ``local`` or ``ray``, placed by ``trainer.placement``) and load
    their models. ``reward_fn`` runs in a worker of its own where the placement maps ``reward``; ``inits``
    (default: ``role_inits``, the PPO roles; keys: a role or its group name) says which workers to start.
    ``overlapping``: the rollout generates while the actor trains (an asynchronous run), so it is a worker of
    its own on the local backend too, and on Ray takes a second call (posted weights) while it generates."""
    given = None if inits is None else {str(name): init for name, init in inits.items()}
    if config.trainer.backend != "ray":
        return _local_worker_groups(config, given, overlapping)
    return _ray_worker_groups(config, reward_fn, given, overlapping)


def _local_worker_groups(
    config: PPOConfig | OfflineConfig, given: dict[str, ClassWithInitArgs] | None, overlapping: bool
) -> WorkerGroups:
    """``build_worker_groups`` on the local backend: the workers live in this process."""
    if config.trainer.return_freed_memory:
        return_freed_memory()
    # an asynchronous run generates while the actor trains: the rollout is a worker of its own
    inits = given or _ppo_inits(config, {"actor": "main", "rollout": "rollout"} if overlapping else None)
    views = {}
    for names in ([n for n in inits if n != "rollout"], [n for n in inits if n == "rollout"]):
        members = {name: inits[name] for name in names}
        if members:
            local = LocalWorkerGroup(create_colocated_worker_cls(members), 1, name_prefix="hybridflow")
            views.update(local.spawn(prefix_set=names))
    return _init_views(views, None, inits)


def _ray_worker_groups(
    config: PPOConfig | OfflineConfig,
    reward_fn: Callable[..., dict] | None,
    given: dict[str, ClassWithInitArgs] | None,
    overlapping: bool,
) -> WorkerGroups:
    """``build_worker_groups`` on Ray: a worker group per resource pool, placed as ``trainer.placement`` says."""
    from hybridflow.single_controller.ray import (
        ProcessSetup,
        RayWorkerGroup,
        ResourcePoolManager,
        init_ray,
        processes_per_node,
    )

    trainer = config.trainer
    pools, roles = placement(trainer)
    extra = pool_resources(trainer, pools)
    inits = given or _ppo_inits(config, roles, reward_fn)
    init_ray(**dict(trainer.ray_kwargs))
    # a worker's pool is its role's (actor_rollout runs where the actor does)
    pool_of = {name: roles["actor" if name == str(Role.ACTOR_ROLLOUT) else name] for name in inits}
    used = {pool: nodes for pool, nodes in pools.items() if pool in pool_of.values()}
    processes = sum(sum(nodes) for nodes in used.values())
    check_pool_resources({pool: res for pool, res in extra.items() if pool in used}, used)
    manager = ResourcePoolManager(
        used,
        {name: pool_of[name] for name in inits},
        use_gpu=trainer.device == "cuda",
        cpus_per_process=ray_cpus_per_worker(trainer, processes),
        max_colocate_count=1,
        pool_resources=extra,
    )
    resource_pools = manager.create_resource_pool()
    setup = ProcessSetup(
        node_processes=processes_per_node(resource_pools.values()),
        share_cores=trainer.share_cores,
        return_freed_memory=trainer.return_freed_memory,
    )
    groups, views = [], {}
    try:
        for pool_name, pool in resource_pools.items():
            members = {name: init for name, init in inits.items() if pool_of[name] == pool_name}
            group = RayWorkerGroup(
                pool,
                create_colocated_worker_cls(members),
                name_prefix=f"hybridflow/{pool_name}",
                setup=setup,
                # an asynchronous run posts weights to the rollout while it generates
                max_concurrency=2 if overlapping and "rollout" in members else 1,
            )
            groups.append(group)
            views.update(group.spawn(prefix_set=list(members)))
    except BaseException:
        _release(groups, resource_pools)
        raise
    return _init_views(views, lambda: _release(groups, resource_pools), inits)


def _release(groups: list, pools: dict) -> None:
    for group in groups:
        group.shutdown()
    for pool in pools.values():
        pool.remove()


def _ppo_inits(
    config: PPOConfig | OfflineConfig,
    roles: dict[str, str] | None,
    reward_fn: Callable[..., Any] | None = None,
) -> dict[str, ClassWithInitArgs[Any]]:
    """``role_inits`` of a PPO config; an offline trainer's config comes with its own ``inits``."""
    if not isinstance(config, PPOConfig):
        raise TypeError(
            f"build_worker_groups: a {type(config).__name__} needs its inits (the workers to start)"
        )
    return role_inits(config, roles, reward_fn)


def _init_views(
    views: dict[str, WorkerGroup], release: Callable[[], None] | None, inits: dict[str, ClassWithInitArgs]
) -> WorkerGroups:
    try:
        for view in views.values():
            view.init_model()
    except BaseException:  # a worker that cannot load its model: the others give their CPUs back too
        if release is not None:
            release()
        raise
    fields = dict(views)
    actor = str(Role.ACTOR_ROLLOUT) if str(Role.ACTOR_ROLLOUT) in fields else "actor"
    fields["actor_rollout"] = fields.pop(actor)
    groups = WorkerGroups(**fields, release=release)
    if groups.ref is None and "ref" in str(inits[actor].kwargs.get("role", "")).split("_"):
        groups.ref = groups.actor_rollout  # LoRA: the actor's workers answer compute_ref_log_prob
    return groups
