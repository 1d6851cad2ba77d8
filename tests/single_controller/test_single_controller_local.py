"""The single controller without Ray: Worker's environment, registration rules, colocation, errors."""

import inspect
import os
import pickle
import subprocess
import sys

import pytest
import torch
from toy_workers import ActorPart, CriticPart, ToyWorker

from hybridflow import DataProto
from hybridflow.single_controller import (
    ClassWithInitArgs,
    Dispatch,
    LocalWorkerGroup,
    Worker,
    WorkerError,
    WorkerFuture,
    create_colocated_worker_cls,
    register,
    register_dispatch_mode,
)
from hybridflow.single_controller.decorator import broadcast


def test_worker_standalone_is_rank_zero_of_one(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    worker = Worker()
    assert (worker.rank, worker.world_size, worker.local_rank, worker.device) == (
        0,
        1,
        0,
        torch.device("cpu"),
    )
    assert worker.init_process_group() is False


def test_trainer_device_decides_the_worker_device(monkeypatch):
    """trainer.device reaches every role's worker: cpu stays cpu even where a GPU is visible."""
    from hybridflow.config.schema import PPOConfig
    from hybridflow.trainer.worker_groups import role_inits

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert Worker("cpu").device == torch.device("cpu")
    assert Worker("cuda").device == Worker("auto").device == torch.device("cuda", 1)
    cfg = PPOConfig(
        train_files="x.parquet",
        use_kl_loss=True,
        **{"reward_model.enable": True, "reward_model.dummy": True, "trainer.device": "cpu"},
    )
    inits = role_inits(cfg.resolve())
    assert len(inits) == 4 and {init.kwargs["device"] for init in inits.values()} == {"cpu"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="asked for device cuda"):
        _ = Worker("cuda").device
    with pytest.raises(ValueError, match="device_type must be auto, cpu or cuda"):
        Worker("gpu")


def test_worker_reads_its_rank_from_the_environment(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert (Worker().rank, Worker().world_size, Worker().local_rank) == (1, 3, 1)
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ValueError, match="RANK=3 is outside WORLD_SIZE=3"):
        Worker()


def test_local_group_builds_each_rank_under_its_env_and_restores_the_driver_env(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    group = LocalWorkerGroup(ClassWithInitArgs(ToyWorker), world_size=3)
    assert [(w.rank, w.world_size, w.formed_group) for w in group.workers] == [
        (0, 3, False),
        (1, 3, False),
        (2, 3, False),
    ]
    assert "RANK" not in os.environ
    assert group.name == "ToyWorker"


def test_local_non_blocking_call_returns_a_resolved_future():
    group = LocalWorkerGroup(ClassWithInitArgs(ToyWorker))
    future = group.sleep(0.0)
    assert isinstance(future, WorkerFuture) and "resolved" not in repr(future)
    assert future.get() == [0] and "resolved" in repr(future)


def test_worker_init_failure_names_rank_and_init():
    with pytest.raises(WorkerError) as info:
        LocalWorkerGroup(ClassWithInitArgs(ActorPart), world_size=2, name_prefix="actor")  # lr missing
    assert (info.value.group, info.value.rank, info.value.method) == ("actor", 0, "__init__")
    assert "missing 1 required positional argument: 'lr'" in str(info.value)
    copy = pickle.loads(pickle.dumps(info.value))
    assert (copy.group, copy.rank, copy.method, str(copy)) == ("actor", 0, "__init__", str(info.value))


def test_builtin_dispatch_modes_cannot_be_replaced():
    with pytest.raises(ValueError, match="'DP_COMPUTE_PROTO' is built in"):
        register_dispatch_mode("DP_COMPUTE_PROTO", broadcast, lambda outputs, shards: outputs)


def test_unknown_dispatch_mode_is_reported_when_a_group_binds_it():
    class Odd(Worker):
        @register("NO_SUCH_MODE")
        def go(self) -> None: ...

    with pytest.raises(KeyError, match="Odd.go: dispatch mode 'NO_SUCH_MODE' is not registered"):
        LocalWorkerGroup(ClassWithInitArgs(Odd))


def test_method_clashing_with_group_attribute_is_refused():
    class Clash(Worker):
        @register(Dispatch.ONE_TO_ALL)
        def spawn(self) -> None: ...

    with pytest.raises(ValueError, match="Clash.spawn clashes with the worker group's own attribute 'spawn'"):
        LocalWorkerGroup(ClassWithInitArgs(Clash))


def test_override_without_decorator_keeps_the_registration():
    class Child(ToyWorker):
        def dp(self, x: int) -> int:
            return -x

    group = LocalWorkerGroup(ClassWithInitArgs(Child), world_size=2)
    assert group.dp([1, 2]) == [-1, -2]  # still DP_COMPUTE: split per rank


def test_colocated_roles_share_the_local_process_and_keep_their_methods():
    init = create_colocated_worker_cls(
        {"actor": ClassWithInitArgs(ActorPart, lr=2.0), "critic": ClassWithInitArgs(CriticPart)}
    )
    group = LocalWorkerGroup(init, world_size=2, name_prefix="hybrid")
    roles = group.spawn(["actor", "critic"])
    assert roles["actor"].pid() == roles["critic"].pid() == [os.getpid()] * 2
    data = DataProto.from_dict({"x": torch.arange(3)})
    assert roles["actor"].act(data).batch["scaled"].tolist() == [0.0, 2.0, 4.0]
    assert roles["critic"].value(data).batch["rank"].tolist() == [0, 0, 1]
    assert (
        str(inspect.signature(roles["actor"].act))
        == "(data: hybridflow.protocol.DataProto) -> hybridflow.protocol.DataProto"
    )
    assert roles["critic"].name == "hybrid/critic"
    assert group.critic__value(data).batch["value"].tolist() == [1, 2, 3]  # the fused name works on the group


def test_spawn_and_colocation_errors():
    with pytest.raises(TypeError, match="ToyWorker is not one"):
        LocalWorkerGroup(ClassWithInitArgs(ToyWorker)).spawn({"actor"})
    group = LocalWorkerGroup(create_colocated_worker_cls({"actor": ClassWithInitArgs(ActorPart, lr=1.0)}))
    with pytest.raises(KeyError, match=r"roles \['ref'\] are not in the colocated class"):
        group.spawn({"actor", "ref"})
    with pytest.raises(ValueError, match="must not contain '__'"):
        create_colocated_worker_cls({"my__role": ClassWithInitArgs(CriticPart)})


def test_single_controller_package_does_not_import_ray():
    code = "import sys, hybridflow.single_controller; assert 'ray' not in sys.modules, 'ray was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
