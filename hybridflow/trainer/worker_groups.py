"""Building the worker groups a PPO run needs, on the local or the Ray backend.

Every role a run needs (actor + rollout, reference, critic, reward model) is colocated in one process per
rank (the hybrid engine: the roles share the devices instead of each taking its own), then split back
into one group view per role. Only the backend differs between a laptop and a cluster: a
``LocalWorkerGroup`` of one rank in the driver's process, or a ``RayWorkerGroup`` of ``n_workers`` ranks.
Every worker runs on ``trainer.device``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridflow.single_controller import (
    ClassWithInitArgs,
    LocalWorkerGroup,
    Role,
    WorkerGroup,
    create_colocated_worker_cls,
)
from hybridflow.utils.errors import UserError
from hybridflow.workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker


@dataclass
class WorkerGroups:
    """One group per role; ``None`` for a role the run does not use."""

    actor_rollout: WorkerGroup
    ref: WorkerGroup | None = None
    critic: WorkerGroup | None = None
    reward_model: WorkerGroup | None = None
    release: Callable[[], None] | None = None  # frees what building the groups took (Ray actors, CPUs)

    def shutdown(self) -> None:
        """Stop the workers and give their resources back; the groups are unusable afterwards."""
        if self.release is not None:
            self.release()
            self.release = None


def needs_ref(config: Any) -> bool:
    """A reference policy is only loaded when a KL term (in the loss or in the reward) uses it."""
    return bool(config.actor_rollout_ref.actor.use_kl_loss or config.algorithm.use_kl_in_reward)


def role_inits(config: Any) -> dict[Role, ClassWithInitArgs]:
    """The deferred constructor of each role's worker for this config."""
    arr = config.actor_rollout_ref
    response_length, seed, device = config.data.max_response_length, config.trainer.seed, config.trainer.device
    # With LoRA the reference is the actor's module with the adapter off: the actor worker takes the role
    ref_in_actor = needs_ref(config) and arr.model.lora_rank > 0
    inits = {Role.ACTOR_ROLLOUT: ClassWithInitArgs(ActorRolloutRefWorker, arr,
                                                   role="actor_rollout_ref" if ref_in_actor else "actor_rollout",
                                                   response_length=response_length, seed=seed, device=device)}
    if needs_ref(config) and not ref_in_actor:
        inits[Role.REF] = ClassWithInitArgs(ActorRolloutRefWorker, arr, role="ref",
                                            response_length=response_length, seed=seed, device=device)
    if config.critic.enable:
        inits[Role.CRITIC] = ClassWithInitArgs(CriticWorker, config.critic, rollout_n=arr.rollout.n, seed=seed,
                                               device=device)
    if config.reward_model.enable:
        inits[Role.REWARD_MODEL] = ClassWithInitArgs(RewardModelWorker, config.reward_model,
                                                     policy_tokenizer_path=arr.model.path, device=device)
    return inits


def check_ray_resources(needed: dict[str, float], n_workers: int) -> None:
    """Refuse up front a run that Ray cannot place (else the placement waits, then fails with Ray's
    resource message): each of ``trainer.n_workers`` workers takes one CPU (and one GPU on cuda)."""
    import ray

    available, total = ray.available_resources(), ray.cluster_resources()
    for kind, amount in needed.items():
        if amount > available.get(kind, 0.0) + 1e-9:
            raise UserError(
                f"trainer.n_workers={n_workers} needs {amount:g} {kind}s on Ray, but Ray sees "
                f"{available.get(kind, 0.0):g} available (of {total.get(kind, 0.0):g}): lower trainer.n_workers "
                f"or give Ray more (trainer.ray_kwargs.num_{kind.lower()}s=..., or a larger Ray cluster)")


def build_worker_groups(config: Any, inits: dict[Role, ClassWithInitArgs] | None = None) -> WorkerGroups:
    """Start the workers (``trainer.backend``: ``local`` or ``ray``) and load their models; ``inits``
    (default: ``role_inits(config)``, the PPO roles) says which roles with which workers."""
    inits = inits if inits is not None else role_inits(config)
    fused = create_colocated_worker_cls(inits)
    trainer = config.trainer
    if trainer.backend == "ray":
        from hybridflow.single_controller.ray import RayResourcePool, RayWorkerGroup, init_ray

        init_ray(**dict(trainer.ray_kwargs))
        pool = RayResourcePool(process_on_nodes=[trainer.n_workers],
                               use_gpu=trainer.device == "cuda", max_colocate_count=1)
        check_ray_resources(pool.required_resources(), trainer.n_workers)
        group: WorkerGroup = RayWorkerGroup(pool, fused, name_prefix="hybridflow")

        def release() -> None:
            group.shutdown()
            pool.remove()
    else:
        group = LocalWorkerGroup(fused, world_size=1, name_prefix="hybridflow")
        release = None
    views = group.spawn(prefix_set=[str(role) for role in inits])
    for view in views.values():
        view.init_model()
    groups = WorkerGroups(**{role: view for role, view in views.items()}, release=release)
    actor_roles = str(inits[Role.ACTOR_ROLLOUT].kwargs.get("role", "")).split("_")
    if groups.ref is None and "ref" in actor_roles:  # LoRA: the actor's workers answer compute_ref_log_prob
        groups.ref = groups.actor_rollout
    return groups
