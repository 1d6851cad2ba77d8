"""``WorkerGroup``: the driver's handle on ``world_size`` workers, whatever runs them.

One call path serves every backend: resolve futures among the arguments, ``dispatch_fn`` splits them
into per-rank shards, the backend starts the method on those ranks, and ``collect_fn`` turns the answers
into one result (now, or later through a ``WorkerFuture``). A backend only knows how to start a method
on some ranks and how to wait for the answers; ``LocalWorkerGroup`` and ``RayWorkerGroup`` differ only
in their backend, so driver code does not change when the backend does.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from hybridflow.single_controller.colocate import ROLE_METHODS_ATTR
from hybridflow.single_controller.decorator import (
    CollectFn,
    Dispatch,
    DispatchMode,
    Execute,
    MethodSpec,
    Shards,
    get_dispatch_mode,
    method_spec,
    registered_methods,
)
from hybridflow.utils.errors import UserError


class WorkerError(RuntimeError):
    """A worker method raised (or its worker died): names the group, rank and method, and carries the
    worker's traceback text, so the driver's error says where to look."""

    def __init__(self, group: str, rank: int, method: str, remote_traceback: str) -> None:
        self.group, self.rank, self.method, self.remote_traceback = group, rank, method, remote_traceback
        super().__init__(
            f"worker group {group!r}, rank {rank}, method {method!r} failed:\n{remote_traceback}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.group, self.rank, self.method, self.remote_traceback)


class WorkerDiedError(WorkerError):
    """The process of a worker is gone (killed, crashed, out of memory): later calls cannot succeed."""


class NodeLostError(UserError):
    """A machine of the cluster left it (crashed, shut down, off the network) and took a rank with it: one
    line naming the node and the role, since the run cannot go on without them; the ``WorkerDiedError``
    with Ray's own words is its ``__cause__``."""

    def __init__(self, node: str, group: str, rank: int, method: str) -> None:
        self.node, self.group, self.rank, self.method = node, group, rank, method
        role = group.rsplit("/", 1)[-1]
        super().__init__(
            f"{node} left the Ray cluster during {method!r}, taking role {role!r} (worker group {group!r}, "
            f"rank {rank}) with it; restart the run with trainer.resume_mode=auto on the nodes that are left "
            "(it resumes from the newest complete checkpoint), after moving the role's pool "
            "(trainer.pool_resources) to a node that has room"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.node, self.group, self.rank, self.method)


def worker_failure(
    error: WorkerError, cause: BaseException | None
) -> tuple[BaseException, BaseException | None]:
    """``(what the driver raises, its __cause__)`` for a failed worker call whose exception was ``cause``.

    A ``UserError`` (the worker found the user's input wrong: a damaged checkpoint, weights that went
    NaN under a huge learning rate) is raised as itself, same type and message, so the command line still
    prints it as one line; ``error`` (group, rank, method, remote traceback) becomes its ``__cause__`` for
    ``--debug``. Anything else raises ``error``, which carries the worker's traceback."""
    return (cause, error) if isinstance(cause, UserError) else (error, cause)


class WorkerBackend(Protocol):
    """What a worker group needs from whatever runs its workers."""

    @property
    def world_size(self) -> int: ...

    @property
    def workers(self) -> list[Any]: ...

    def submit(self, method: str, shards: Shards, group: str, label: str) -> list[Any]:
        """Start ``method`` on ranks ``0 .. len(shards) - 1`` with their shard; returns one handle per rank.
        ``group`` and ``label`` (the method's public name) are for error messages."""

    def fetch(self, handles: list[Any], group: str, label: str, timeout_s: float | None = None) -> list[Any]:
        """Wait for the handles of ``submit`` (at most ``timeout_s``, else the backend's default); returns
        the results in rank order or raises ``WorkerError``."""


class WorkerFuture:
    """The result of a non-blocking call: ``get()`` waits for the workers and collects their answers.

    Pass it straight into the next group call: the group resolves futures among the arguments, so
    independent stages submitted one after the other run at the same time.
    """

    def __init__(
        self,
        backend: WorkerBackend,
        handles: list[Any],
        collect_fn: CollectFn,
        shards: Shards,
        group: str,
        label: str,
    ) -> None:
        self._backend, self._handles, self._collect_fn, self._shards = backend, handles, collect_fn, shards
        self._group, self._label = group, label
        self._resolved = False
        self._value: Any = None

    def get(self, timeout_s: float | None = None) -> Any:
        """Wait for every rank and return the collected result (computed once, then cached). With
        ``timeout_s``, raise ``WorkerError`` naming the ranks that have not answered in time; the future
        stays pending, so ``get`` may be called again."""
        if not self._resolved:
            outputs = self._backend.fetch(self._handles, self._group, self._label, timeout_s)
            self._value = self._collect_fn(outputs, self._shards)
            self._resolved, self._handles = True, []
        return self._value

    def __repr__(self) -> str:
        state = "resolved" if self._resolved else f"{len(self._handles)} ranks pending"
        return f"WorkerFuture({self._group}.{self._label}, {state})"


class WorkerGroup:
    """``world_size`` workers of one class, driven as one object.

    Every ``@register``-ed method of the worker class becomes a method of the group with the same name,
    docstring and signature (minus ``self``). ``spawn`` gives one view per role of a colocated class.
    """

    def __init__(
        self, backend: WorkerBackend, worker_cls: type, name: str, method_names: dict[str, str] | None = None
    ) -> None:
        """``method_names`` maps public names to the worker's method names (a role's view of a colocated
        class); by default every registered method under its own name."""
        self._backend = backend
        self._worker_cls = worker_cls
        self._name = name
        if method_names is None:
            method_names = {method: method for method in registered_methods(worker_cls)}
        self._remote_names = dict(method_names)
        for public, remote in self._remote_names.items():
            self._bind(public, remote)

    if TYPE_CHECKING:
        # the worker class's @register-ed methods are bound per group by name (``_bind``): to a type
        # checker, an attribute the class does not define is one of them
        def __getattr__(self, name: str) -> Callable[..., Any]: ...

    @property
    def name(self) -> str:
        return self._name

    @property
    def world_size(self) -> int:
        return self._backend.world_size

    @property
    def workers(self) -> list[Any]:
        """The worker objects (local) or Ray actor handles, by rank."""
        return self._backend.workers

    def execute_all(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method_name`` (registered or not) on every rank with the same arguments; results by rank."""
        results: list[Any] = self._call(method_name, MethodSpec(Dispatch.ONE_TO_ALL.value), args, kwargs)
        return results

    def execute_rank_zero(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method_name`` on rank 0 only and return its result."""
        return self._call(method_name, MethodSpec(Dispatch.RANK_ZERO.value), args, kwargs)

    def spawn(self, prefix_set: Iterable[str]) -> dict[str, WorkerGroup]:
        """One group per role of a colocated worker class (``create_colocated_worker_cls``): same workers,
        same processes, methods of that role only. Keys are the role names."""
        roles: dict[str, dict[str, str]] | None = getattr(self._worker_cls, ROLE_METHODS_ATTR, None)
        if roles is None:
            raise TypeError(
                f"spawn() needs a group of a colocated worker class; {self._worker_cls.__qualname__} "
                "is not one (build it with create_colocated_worker_cls)"
            )
        wanted = list(prefix_set)
        unknown = sorted(set(wanted) - set(roles))
        if unknown:
            raise KeyError(
                f"roles {unknown} are not in the colocated class {self._name}; it has {sorted(roles)}"
            )
        return {
            role: WorkerGroup(self._backend, self._worker_cls, f"{self._name}/{role}", roles[role])
            for role in wanted
        }

    def _bind(self, public: str, remote: str) -> None:
        if hasattr(type(self), public):
            raise ValueError(
                f"{self._worker_cls.__qualname__}.{remote} clashes with the worker group's own "
                f"attribute {public!r}; rename the worker method"
            )
        spec = method_spec(self._worker_cls, remote)
        if spec is None:
            raise ValueError(f"{self._worker_cls.__qualname__}.{remote} is not @register-ed")
        try:
            get_dispatch_mode(spec.dispatch_mode)
        except KeyError as e:
            raise KeyError(f"{self._worker_cls.__qualname__}.{remote}: {e.args[0]}") from None
        setattr(self, public, _group_method(self, public, spec, getattr(self._worker_cls, remote)))

    def _call(self, method: str, spec: MethodSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The one call path: resolve futures, dispatch, submit, then collect now or return a future.
        ``method`` is the public name (a role's view maps it to the colocated class's method)."""
        mode: DispatchMode = get_dispatch_mode(spec.dispatch_mode)
        args = tuple(_resolve(a) for a in args)
        kwargs = {k: _resolve(v) for k, v in kwargs.items()}
        shards = mode.dispatch_fn(self.world_size, args, kwargs)
        if not 1 <= len(shards) <= self.world_size or len(shards.kwargs) != len(shards):
            raise ValueError(
                f"dispatch mode {spec.dispatch_mode!r} made {len(shards)} shards "
                f"({len(shards.kwargs)} kwargs) for a group of {self.world_size} workers"
            )
        if spec.execute_mode is Execute.RANK_ZERO:
            shards = shards.first()
        handles = self._backend.submit(self._remote_names.get(method, method), shards, self._name, method)
        future = WorkerFuture(self._backend, handles, mode.collect_fn, shards, self._name, method)
        return future.get() if spec.blocking else future

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._name!r}, world_size={self.world_size})"


def _resolve(value: Any) -> Any:
    return value.get() if isinstance(value, WorkerFuture) else value


def _group_method(
    group: WorkerGroup, public: str, spec: MethodSpec, worker_method: Callable[..., Any]
) -> Callable[..., Any]:
    """A function that calls the method through the group, looking like the worker method to ``help()``."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return group._call(public, spec, args, kwargs)

    wrapper: Any = functools.update_wrapper(call, worker_method)  # a function whose attributes we set
    del wrapper.__wrapped__  # so inspect uses the signature below, not the worker's (which has ``self``)
    signature = inspect.signature(worker_method)
    wrapper.__signature__ = signature.replace(parameters=list(signature.parameters.values())[1:])
    return call
