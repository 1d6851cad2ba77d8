"""``Worker``: the base class of everything a worker group drives, and ``ClassWithInitArgs``.

A worker learns its place from the environment, as a ``torchrun`` process would (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT). The worker group sets those before constructing it, so user
classes take no distributed arguments and the same class runs standalone (rank 0 of 1), in a
``LocalWorkerGroup`` or as a Ray actor.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

# Set by LocalWorkerGroup when it simulates several ranks inside one process: no process group can be
# formed there (every rank would wait for the others, which run after it), so init_process_group skips.
SIMULATED_RANKS_ENV = "HYBRIDFLOW_SIMULATED_RANKS"
# Set by a worker group whose workers may run on other machines: how logs and errors name the worker's node.
NODE_ENV = "HYBRIDFLOW_NODE"

T = TypeVar("T")
logger = logging.getLogger(__name__)


class Worker:
    """Base class for worker classes; subclasses call ``super().__init__()`` first.

    Exposes ``rank``, ``world_size``, ``local_rank`` and ``device``. ``device_type`` (a run's
    ``trainer.device``) decides it: ``cpu``, ``cuda`` (``cuda:<local rank>``), or ``auto`` (cuda when
    visible, else cpu). Methods decorated with ``@register`` become methods of the worker group.
    """

    def __init__(self, device_type: str = "auto") -> None:
        if device_type not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device_type must be auto, cpu or cuda, got {device_type!r}")
        self._device_type = device_type
        env = os.environ
        self._rank = int(env.get("RANK", "0"))
        self._world_size = int(env.get("WORLD_SIZE", "1"))
        self._local_rank = int(env.get("LOCAL_RANK", "0"))
        self._master_addr = env.get("MASTER_ADDR")
        self._master_port = env.get("MASTER_PORT")
        self._simulated = env.get(SIMULATED_RANKS_ENV) == "1"
        if not 0 <= self._rank < self._world_size:
            raise ValueError(f"RANK={self._rank} is outside WORLD_SIZE={self._world_size}")

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def device(self) -> torch.device:
        """``cuda:<local rank>`` (modulo the visible GPUs, since Ray may show each actor only its own), or cpu."""
        if self._device_type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(
                "this worker was asked for device cuda (trainer.device=cuda), but torch sees no GPU"
            )
        if self._device_type == "cuda" or (self._device_type == "auto" and torch.cuda.is_available()):
            return torch.device("cuda", self._local_rank % torch.cuda.device_count())
        return torch.device("cpu")

    def pid(self) -> int:
        """This worker's process id: where a role runs (``group.execute_all("pid")``)."""
        return os.getpid()

    def node(self) -> str:
        """The machine this worker runs on, as logs and errors name it (a Ray node id and IP, else the host)."""
        return os.environ.get(NODE_ENV) or f"host {socket.gethostname()}"

    def peek_file(self, path: str) -> str | None:
        """The text of a small file as this worker's machine sees it, or None where it does not exist: how
        the driver checks that a folder it writes is the same folder for every worker."""
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            return None

    def init_process_group(self, timeout_s: float = 600.0) -> bool:
        """Form the ``torch.distributed`` group of this worker group: nccl on GPU, gloo on CPU.

        Every rank must call it (it blocks until all have joined). Returns False without doing anything
        when there is nothing to form: world size 1, a group already formed in this process (colocated
        roles share one), or ranks simulated in one process by ``LocalWorkerGroup``.
        """
        if self._world_size == 1 or dist.is_initialized():
            return False
        if self._simulated:
            logger.info(
                "rank %d of %d is simulated in one process: no process group formed",
                self._rank,
                self._world_size,
            )
            return False
        if not (self._master_addr and self._master_port):
            raise RuntimeError(
                f"rank {self._rank} of {self._world_size}: MASTER_ADDR / MASTER_PORT are not set; "
                "workers get them from their worker group"
            )
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{self._master_addr}:{self._master_port}",
            rank=self._rank,
            world_size=self._world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        return True


class ClassWithInitArgs(Generic[T]):
    """A deferred constructor: ``ClassWithInitArgs(cls, *args, **kwargs)()`` builds ``cls(*args, **kwargs)``.

    Worker groups take one so that they can build the worker where it will live (in this process, or
    inside a Ray actor after its environment is set) and as many times as they have ranks.
    """

    def __init__(self, cls: type[T], *args: Any, **kwargs: Any) -> None:
        if not isinstance(cls, type):
            raise TypeError(f"ClassWithInitArgs needs a class, got {cls!r}")
        self.cls = cls
        self.args = args
        self.kwargs = kwargs

    def __call__(self) -> T:
        return self.cls(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        return (
            f"ClassWithInitArgs({self.cls.__qualname__}, args={len(self.args)}, kwargs={sorted(self.kwargs)})"
        )
