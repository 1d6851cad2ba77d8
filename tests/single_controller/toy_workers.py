"""Worker classes shared by the single-controller tests (imported by the driver; Ray workers unpickle them)."""

import os
import time

import torch
import torch.distributed as dist

from hybridflow import DataProto
from hybridflow.single_controller import Dispatch, Execute, Shards, Worker, register, register_dispatch_mode
from hybridflow.utils.errors import InputError


def deal_round_robin(world_size: int, args: tuple, kwargs: dict) -> Shards:
    """User mode: rank r gets items r, r + world_size, ... of the single list argument."""
    (items,) = args
    return Shards([(items[r::world_size],) for r in range(world_size)], [{} for _ in range(world_size)])


def gather_round_robin(outputs: list, shards: Shards) -> list:
    """Put the ranks' answers back in the order of the items they were dealt."""
    merged = [None] * sum(len(part) for part in outputs)
    for rank, part in enumerate(outputs):
        merged[rank :: len(outputs)] = part
    return merged


register_dispatch_mode("ROUND_ROBIN", deal_round_robin, gather_round_robin)


class ToyWorker(Worker):
    """One method per dispatch mode; each answer shows which rank computed what."""

    def __init__(self, offset: int = 0) -> None:
        super().__init__()
        self.offset = offset
        self.formed_group = self.init_process_group()

    @register(Dispatch.ONE_TO_ALL)
    def info(self) -> dict:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "pid": os.getpid(),
            "formed_group": self.formed_group,
            "device": str(self.device),
            "offset": self.offset,
        }

    def whoami(self) -> int:  # not registered: reachable through execute_all / execute_rank_zero only
        return self.rank

    @register(Dispatch.ALL_TO_ALL)
    def add_rank(self, x: int, y: int = 0) -> int:
        return x + y + 10 * self.rank

    @register(Dispatch.RANK_ZERO)
    def only_zero(self, x: int) -> tuple:
        return (self.rank, x)

    @register(Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def broadcast_on_zero(self, x: int) -> int:
        return x + self.rank + 1

    @register(Dispatch.DP_COMPUTE)
    def dp(self, x: int) -> int:
        return 2 * x + self.rank

    @register(Dispatch.DP_COMPUTE_PROTO)
    def tag_rows(self, data: DataProto) -> DataProto:
        """Doubles ``x`` (bs,) and records the rank that saw each row."""
        n = len(data)
        return DataProto.from_dict(
            {"x": data.batch["x"] * 2, "rank": torch.full((n,), self.rank)},
            non_tensors={"uid": data.non_tensor_batch["uid"]},
            meta_info={"metrics": {"rows": n}},
        )

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def tag_rows_async(self, data: DataProto) -> DataProto:
        return self.tag_rows(data)

    @register(Dispatch.DP_COMPUTE_METRIC)
    def row_sum(self, data: DataProto) -> dict:
        return {"rank": self.rank, "sum": int(data.batch["x"].sum())}

    @register("ROUND_ROBIN")
    def square(self, items: list) -> list:
        return [(x * x, self.rank) for x in items]

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"boom from rank {self.rank}")
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def refuse_input(self, rank: int) -> int:
        """An input error found by one rank (a damaged file, a diverged model)."""
        if self.rank == rank:
            raise InputError(f"data.bin: row {self.rank} is malformed")
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce(self, value: float) -> float:
        """Sum of ``value * (rank + 1)`` over the ranks, through the process group."""
        tensor = torch.tensor([value * (self.rank + 1)])
        dist.all_reduce(tensor)
        return tensor.item()


class ActorPart(Worker):
    """A role of the colocated tests: scales rows by its learning rate."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(Dispatch.DP_COMPUTE_PROTO)
    def act(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"scaled": data.batch["x"].float() * self.lr})


class CriticPart(Worker):
    """The other colocated role: answers ``x + 1`` and its own rank."""

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(Dispatch.DP_COMPUTE_PROTO)
    def value(self, data: DataProto) -> DataProto:
        return DataProto.from_dict(
            {"value": data.batch["x"] + 1, "rank": torch.full((len(data),), self.rank)}
        )

    @register(Dispatch.ONE_TO_ALL)
    def torch_threads(self) -> int:
        return torch.get_num_threads()

    @register(Dispatch.ONE_TO_ALL)
    def work_until(self, released: str) -> None:
        """Stay at work (a call in progress, as the core share sees it) until the file ``released`` exists."""
        while not os.path.exists(released):
            time.sleep(0.01)
