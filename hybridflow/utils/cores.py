"""A node's cores shared among its worker processes as their work comes and goes.

Why: on a machine of few cores, a run's processes that take turns (an asynchronous run's trainer and rollout,
split placement's actor and rollout) each got a fixed share of the cores, so one idled its share while the
other worked on half of them: measured on 2 cores, an update took 6.2-6.6 s on its one core beside a rollout
that was idle a third of the time, against 3.1-3.3 s on both. Here each process says when it works
(``CoreShare.working``, around every call a worker runs) and, while it works, takes the node's cores divided by
the processes working at that moment (``rebalance``), so a process alone at work gets them all.

How: every sharing process of the machine (of any run, under this user) has a file in one folder of
``/dev/shm`` (or the temporary folder), named by its pid, with a ``.busy`` suffix while it works; a process
that died is pruned by whoever counts next. torch's thread count is a setting of each OS thread (OpenMP's),
so it is changed by the thread that computes, where it can: at every call, before each layer of a model
``follow`` was given runs its forward (a decoding step runs every layer), and as each layer's backward begins;
each thread re-reads the folder at most every ``RECHECK_S``. Between two such points a process can run one
layer with more threads than its share.

May import: ``hybridflow.utils.processes``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import torch

from hybridflow.utils.processes import process_alive

RECHECK_S = 0.01  #: how often, at most, a computing thread re-reads who works (seconds)
_BUSY = ".busy"
ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


def shared_folder() -> Path:
    """The folder of this machine's sharing processes: in memory where the OS has one (cleared at boot)."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return root / f"hybridflow-cores-{os.getuid() if hasattr(os, 'getuid') else 0}"


class CoreShare:
    """This process's part in sharing ``cores`` with the other processes that have a file in ``folder``."""

    def __init__(self, cores: int, folder: Path | None = None) -> None:
        self.cores = cores
        self.folder = folder or shared_folder()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._pid = os.getpid()
        self._idle, self._busy = self.folder / str(self._pid), self.folder / f"{self._pid}{_BUSY}"
        self._mark(busy=False)
        self._calls = 0  # calls at work now (several run at once in an actor of max_concurrency > 1)
        self._lock = threading.Lock()
        self._checked = threading.local()  # when this thread last re-read the folder
        atexit.register(self.leave)

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        """Mark this process at work for the block, and take its share of the cores for this thread now."""
        with self._lock:
            self._calls += 1
            if self._calls == 1:
                self._mark(busy=True)
        try:
            self.rebalance(now=True)
            yield
        finally:
            with self._lock:
                self._calls -= 1
                if self._calls == 0:
                    self._mark(busy=False)

    def _mark(self, busy: bool) -> None:
        """Name this process's file for its state (recreating the folder if someone cleared it)."""
        now, before = (self._busy, self._idle) if busy else (self._idle, self._busy)
        try:
            now.touch()
        except FileNotFoundError:
            self.folder.mkdir(parents=True, exist_ok=True)
            now.touch()
        before.unlink(missing_ok=True)

    def busy_processes(self) -> int:
        """Processes at work now, this one counted whether or not it is (at least 1); files of dead ones go."""
        count = 1
        for name in os.listdir(self.folder):
            pid_text = name.removesuffix(_BUSY)
            if not pid_text.isdigit() or int(pid_text) == self._pid:
                continue
            if not process_alive(int(pid_text)):
                (self.folder / name).unlink(missing_ok=True)
            elif name.endswith(_BUSY):
                count += 1
        return count

    def threads(self) -> int:
        """A call's share of the cores now: this process's share split among its calls at work (a rollout
        taking weights while it generates runs two), at least 1."""
        return max(1, self.cores // self.busy_processes() // max(1, self._calls))

    def rebalance(self, now: bool = False) -> None:
        """Set the calling thread's torch threads to ``threads()``, unless it did within ``RECHECK_S``."""
        clock = time.monotonic()
        if not now and clock - getattr(self._checked, "at", -RECHECK_S) < RECHECK_S:
            return
        self._checked.at = clock
        threads = self.threads()
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    def leave(self) -> None:
        """Take this process's file away (at exit; a killed process's file is pruned by the others)."""
        self._idle.unlink(missing_ok=True)
        self._busy.unlink(missing_ok=True)


_share: CoreShare | None = None


def share_cores(cores: int, folder: Path | None = None) -> CoreShare:
    """Make this process share ``cores`` (once per process; the models ``follow`` is given then rebalance)."""
    global _share
    if _share is None:
        _share = CoreShare(cores, folder)
    return _share


def rebalance() -> None:
    """Retake this thread's share of the cores, at most every ``RECHECK_S``, where this process shares them: for
    a loop of work that runs no model ``follow`` was given (a weight sync's buckets), at each step."""
    if _share is not None:
        _share.rebalance()


def _rebalance(*_: object) -> None:
    rebalance()


def _after_layer(_module: torch.nn.Module, _args: object, output: object) -> None:
    """Rebalance as this layer's backward begins: a hook on its output's gradient (it changes nothing)."""
    first = output[0] if isinstance(output, (tuple, list)) and output else output
    if isinstance(first, torch.Tensor) and first.requires_grad:
        first.register_hook(_rebalance)


def follow(model: ModuleT) -> ModuleT:
    """Rebalance before each layer's forward and backward: the members of every ``ModuleList`` of ``model``
    (a transformer's blocks). Nothing is added where this process does not share its cores."""
    if _share is None:
        return model
    for stack in (m for m in model.modules() if isinstance(m, torch.nn.ModuleList)):
        for layer in stack:
            layer.register_forward_pre_hook(_rebalance)
            layer.register_forward_hook(_after_layer)
    return model
