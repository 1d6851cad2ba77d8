"""``LocalWorkerGroup``: the workers live in the driver's own process (no Ray).

The default on one machine, and the way to debug a dataflow with a plain debugger: a call runs the
worker method right there. With ``world_size > 1`` the group holds that many worker objects and runs
them one after the other, each built under the environment it would get as a real rank, so dispatch
and collection behave exactly as on Ray; no process group is formed (the ranks cannot meet in one
thread), so collectives are not available there.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hybridflow.single_controller.decorator import Shards
from hybridflow.single_controller.worker import SIMULATED_RANKS_ENV, ClassWithInitArgs
from hybridflow.single_controller.worker_group import WorkerError, WorkerGroup, worker_failure


class LocalWorkerGroup(WorkerGroup):
    """``world_size`` workers built from ``cls_with_init`` in this process.

    Non-blocking methods run at once and return an already resolved ``WorkerFuture``, so driver code is
    the same as with ``RayWorkerGroup`` (a failure is raised by the call itself, not by ``get``). Workers
    receive the driver's objects themselves, not copies.
    """

    def __init__(
        self, cls_with_init: ClassWithInitArgs[Any], world_size: int = 1, name_prefix: str | None = None
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        name = name_prefix or cls_with_init.cls.__name__
        workers = []
        for rank in range(world_size):
            with _rank_env(rank, world_size):
                try:
                    workers.append(cls_with_init())
                except Exception as e:
                    raised, cause = worker_failure(
                        WorkerError(name, rank, "__init__", traceback.format_exc()), e
                    )
                    raise raised from cause
        super().__init__(_LocalBackend(workers), cls_with_init.cls, name)


class _LocalBackend:
    """Runs each rank's shard on its worker object, in rank order, at submit time."""

    def __init__(self, workers: list[Any]) -> None:
        self._workers = workers

    @property
    def world_size(self) -> int:
        return len(self._workers)

    @property
    def workers(self) -> list[Any]:
        return list(self._workers)

    def submit(self, method: str, shards: Shards, group: str, label: str) -> list[Any]:
        results = []
        for rank, (args, kwargs) in enumerate(zip(shards.args, shards.kwargs)):
            try:
                results.append(getattr(self._workers[rank], method)(*args, **kwargs))
            except Exception as e:
                raised, cause = worker_failure(WorkerError(group, rank, label, traceback.format_exc()), e)
                raise raised from cause
        return results

    def fetch(self, handles: list[Any], group: str, label: str, timeout_s: float | None = None) -> list[Any]:
        return handles  # already computed at submit time


@contextmanager
def _rank_env(rank: int, world_size: int) -> Iterator[None]:
    """The environment a real rank would see, for the duration of the worker's construction."""
    values = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        SIMULATED_RANKS_ENV: "1" if world_size > 1 else "0",
    }
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
