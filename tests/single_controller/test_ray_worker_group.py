"""Ray-only behaviour outside the toy group: colocated roles in one actor process, a killed actor, resource pools."""

import os
import re
import threading
import time

import pytest
import ray
import torch
from toy_workers import ActorPart, CriticPart

from hybridflow import DataProto
from hybridflow.single_controller import (
    ClassWithInitArgs,
    Role,
    WorkerDiedError,
    create_colocated_worker_cls,
)
from hybridflow.single_controller.ray import (
    ProcessSetup,
    RayResourcePool,
    RayWorkerGroup,
    ResourcePoolManager,
    processes_per_node,
)
from hybridflow.single_controller.ray.worker_group import usable_cpus
from hybridflow.utils.cores import shared_folder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_colocated_roles_share_a_process_and_a_killed_actor_is_reported(ray_session):
    pool = RayResourcePool([1], cpus_per_process=0.25, name="colocated")  # one rank: actor starts are costly
    init = create_colocated_worker_cls(
        {"actor": ClassWithInitArgs(ActorPart, lr=0.5), Role.CRITIC: ClassWithInitArgs(CriticPart)}
    )
    group = RayWorkerGroup(pool, init, name_prefix="hybrid")
    try:
        roles = group.spawn({"actor", Role.CRITIC})
        actor, critic = roles["actor"], roles[Role.CRITIC]
        [pid] = actor.pid()
        assert critic.pid() == [pid] and pid != os.getpid()
        # ProcessSetup.torch_threads: the only process on its node gets every CPU (Ray alone would give it 1 thread)
        assert critic.torch_threads() == [usable_cpus()]
        data = DataProto.from_dict({"x": torch.arange(5)})
        assert actor.act(data).batch["scaled"].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0]
        assert critic.value(data).batch["value"].tolist() == [1, 2, 3, 4, 5]
        assert not hasattr(actor, "value") and not hasattr(critic, "act")

        ray.kill(group.workers[0])
        start = time.monotonic()
        while _alive(pid) and time.monotonic() - start < 30:  # ray.kill returns before the process is gone
            time.sleep(0.05)
        with pytest.raises(WorkerDiedError) as info:
            critic.value(data)
        assert time.monotonic() - start < 30
        assert (info.value.group, info.value.rank, info.value.method) == ("hybrid/critic", 0, "value")
        assert "killed by `ray.kill`" in str(info.value)
    finally:
        group.shutdown()
        pool.remove()


def _two_pools_on_one_node(setup: dict) -> tuple[list[RayWorkerGroup], list[RayResourcePool]]:
    manager = ResourcePoolManager(
        {"train": [1], "gen": [1]}, {"actor": "train", "rollout": "gen"}, cpus_per_process=0.1
    )
    pools = manager.create_resource_pool()
    node = ray.get_runtime_context().get_node_id()
    assert processes_per_node(pools.values()) == {node: 2}
    process_setup = ProcessSetup(node_processes=processes_per_node(pools.values()), **setup)
    groups = [
        RayWorkerGroup(pool, ClassWithInitArgs(CriticPart), name_prefix=name, setup=process_setup)
        for name, pool in pools.items()
    ]
    return groups, list(pools.values())


def _shut(groups: list[RayWorkerGroup], pools: list[RayResourcePool]) -> None:
    for group in groups:
        group.shutdown()
    for pool in pools:
        pool.remove()


def test_processes_of_two_pools_on_one_node_split_its_cpus(ray_session):
    """Split placement on one machine, the fixed share: each process takes half the CPUs as torch threads, not
    all of them (two pools' processes that each took every CPU ran an update 2-3x slower beside a generating
    rollout)."""
    groups, pools = _two_pools_on_one_node({"share_cores": False, "return_freed_memory": True})
    try:
        assert [g.torch_threads() for g in groups] == [[max(1, usable_cpus() // 2)]] * 2
    finally:
        _shut(groups, pools)


def test_a_process_takes_the_cores_of_one_that_waits(ray_session, tmp_path):
    """The shared cores (the default): a process alone at work takes every CPU; beside one at work, half."""
    groups, pools = _two_pools_on_one_node({})
    released = tmp_path / "released"
    try:
        train, gen = groups
        assert train.torch_threads() == [usable_cpus()] and gen.torch_threads() == [usable_cpus()]
        [gen_pid] = gen.pid()  # asked first: the actor runs one call at a time
        working = threading.Thread(target=gen.work_until, args=(str(released),))
        working.start()
        busy = shared_folder() / f"{gen_pid}.busy"
        start = time.monotonic()
        while not busy.exists() and time.monotonic() - start < 60:  # the call has reached the worker
            time.sleep(0.01)
        assert train.torch_threads() == [max(1, usable_cpus() // 2)]
        released.touch()
        working.join()
        assert train.torch_threads() == [usable_cpus()]
    finally:
        released.touch()
        _shut(groups, pools)


def test_resource_pool_manager_says_which_resources_are_missing(ray_session):
    manager = ResourcePoolManager({"big": [64]}, {Role.ACTOR_ROLLOUT: "big"})
    with pytest.raises(RuntimeError, match=r"CPU: need 64, available [0-9.]+"):
        manager.create_resource_pool()


def test_resource_pool_manager_maps_roles_to_shared_pools(ray_session):
    manager = ResourcePoolManager(
        {"shared": [1], "solo": [1]},
        {Role.ACTOR_ROLLOUT: "shared", "ref": "shared", Role.CRITIC: "solo"},
        cpus_per_process=0.1,
    )
    pools = manager.create_resource_pool()
    try:
        assert (
            manager.get_resource_pool("actor_rollout")
            is manager.get_resource_pool(Role.REF)
            is pools["shared"]
        )
        assert manager.get_resource_pool("critic") is pools["solo"]
        assert (pools["shared"].max_colocate_count, pools["solo"].max_colocate_count) == (2, 1)
        with pytest.raises(KeyError, match="'reward_model' has no resource pool"):
            manager.get_resource_pool(Role.REWARD_MODEL)
        pools["solo"].acquire("critic_wg")
        with pytest.raises(
            RuntimeError, match=re.escape("already holds ['critic_wg'] (max_colocate_count=1)")
        ):
            pools["solo"].acquire("other_wg")
    finally:
        for pool in pools.values():
            pool.remove()


def test_resource_pool_manager_rejects_undefined_pools():
    with pytest.raises(KeyError, match="undefined pools {'critic': 'gpu'}"):
        ResourcePoolManager({"cpu": [1]}, {Role.CRITIC: "gpu"})
