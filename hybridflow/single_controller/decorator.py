"""``@register``: how one driver call fans out to the ranks of a worker group and how the answers come back.

A dispatch mode is a pair of plain functions kept in one table (built-in and user modes alike):

- ``dispatch_fn(world_size, args, kwargs) -> Shards``: the per-rank arguments. A dispatch may return
  fewer shards than ranks; then only ranks ``0 .. len(shards) - 1`` run (``RANK_ZERO`` returns one).
- ``collect_fn(outputs, shards) -> result``: turns the list of per-rank results (one per shard, in rank
  order) into what the driver gets. It sees the shards so it can undo what the dispatch did (padding).

Both run on the driver only, so a user mode registered in the driver script works even though worker
processes never import that script.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

from hybridflow.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto

SPEC_ATTR = "__hybridflow_method__"
F = TypeVar("F", bound=Callable[..., Any])


class Dispatch(str, Enum):
    """Built-in dispatch modes. A str enum, so ``Dispatch.ONE_TO_ALL == "ONE_TO_ALL"`` and user modes
    (plain strings) live in the same table."""

    ONE_TO_ALL = "ONE_TO_ALL"  # same arguments to every rank; result: list, one entry per rank
    ALL_TO_ALL = "ALL_TO_ALL"  # every argument is a list of world_size per-rank values; result: list
    RANK_ZERO = "RANK_ZERO"  # only rank 0 runs; result: rank 0's return value
    DP_COMPUTE = "DP_COMPUTE"  # like ALL_TO_ALL (data-parallel compute on pre-split inputs)
    DP_COMPUTE_PROTO = (
        "DP_COMPUTE_PROTO"  # DataProto args split into world_size chunks; result: one DataProto
    )
    DP_COMPUTE_METRIC = "DP_COMPUTE_METRIC"  # split like DP_COMPUTE_PROTO; result: list, one entry per rank


class Execute(str, Enum):
    """Which ranks run a call: every rank, or rank 0 only (then the dispatch's first shard goes to rank 0)."""

    ALL = "ALL"
    RANK_ZERO = "RANK_ZERO"


@dataclass
class Shards:
    """Per-rank call arguments made by a dispatch function: ``args[i]`` / ``kwargs[i]`` go to rank ``i``.

    ``pad_size`` is the number of padding rows the dispatch appended to the DataProto arguments before
    splitting them; the collect function removes that many rows from the concatenated result."""

    args: list[tuple[Any, ...]]
    kwargs: list[dict[str, Any]]
    pad_size: int = 0

    def __len__(self) -> int:
        return len(self.args)

    def first(self) -> Shards:
        """Only rank 0's shard (for ``Execute.RANK_ZERO``)."""
        return Shards(self.args[:1], self.kwargs[:1], self.pad_size)


DispatchFn = Callable[[int, tuple[Any, ...], dict[str, Any]], Shards]
CollectFn = Callable[[list[Any], Shards], Any]


@dataclass(frozen=True)
class MethodSpec:
    """What ``@register`` records on a worker method."""

    dispatch_mode: str
    execute_mode: Execute = Execute.ALL
    blocking: bool = True


@dataclass(frozen=True)
class DispatchMode:
    dispatch_fn: DispatchFn
    collect_fn: CollectFn


_MODES: dict[str, DispatchMode] = {}
_BUILTIN: frozenset[str] = frozenset(m.value for m in Dispatch)


def register(
    dispatch_mode: Dispatch | str = Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
) -> Callable[[F], F]:
    """Mark a worker method as callable from a worker group (``wg.<name>(...)``).

    The method itself is returned unchanged (it still runs normally inside the worker); the mode is
    looked up when a group binds it, so a user mode may be registered after the worker class is defined.
    ``blocking=False`` makes the group call return a ``WorkerFuture`` instead of the result.
    """
    spec = MethodSpec(_mode_name(dispatch_mode), Execute(execute_mode), bool(blocking))

    def mark(method: F) -> F:
        setattr(method, SPEC_ATTR, spec)
        return method

    return mark


def register_dispatch_mode(name: str, dispatch_fn: DispatchFn, collect_fn: CollectFn) -> None:
    """Add (or replace) a user dispatch mode usable as ``@register(dispatch_mode=name)``.

    ``dispatch_fn(world_size, args, kwargs)`` returns ``Shards``; ``collect_fn(outputs, shards)`` builds the
    driver's result from the per-rank outputs. Built-in modes cannot be replaced.
    """
    if name in _BUILTIN:
        raise ValueError(f"dispatch mode {name!r} is built in and cannot be replaced")
    _MODES[name] = DispatchMode(dispatch_fn, collect_fn)


def get_dispatch_mode(name: Dispatch | str) -> DispatchMode:
    """The (dispatch_fn, collect_fn) pair of a mode; raises naming the known modes."""
    key = _mode_name(name)
    if key not in _MODES:
        raise KeyError(f"dispatch mode {key!r} is not registered; known modes: {sorted(_MODES)}")
    return _MODES[key]


def method_spec(cls: type, name: str) -> MethodSpec | None:
    """The ``@register`` spec of ``cls.<name>``, searching the MRO so that an override without the
    decorator keeps the registration of the method it overrides."""
    for klass in cls.__mro__:
        spec = getattr(klass.__dict__.get(name), SPEC_ATTR, None)
        if isinstance(spec, MethodSpec):  # what @register stores
            return spec
    return None


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """Every ``@register``-ed method of ``cls`` (including inherited ones), by name."""
    names = {name for klass in cls.__mro__ for name in klass.__dict__}
    found = {name: method_spec(cls, name) for name in sorted(names)}
    return {name: spec for name, spec in found.items() if spec is not None}


def _mode_name(mode: Dispatch | str) -> str:
    return mode.value if isinstance(mode, Dispatch) else str(mode)


# ---------------------------------------------------------------------------------------- built-in modes
def broadcast(world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Shards:
    """The same arguments to every rank."""
    return Shards([args] * world_size, [kwargs] * world_size)


def rank_zero_only(world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Shards:
    """One shard: only rank 0 runs."""
    return Shards([args], [kwargs])


def split_lists(world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Shards:
    """Every argument is a list/tuple of ``world_size`` values; rank ``i`` gets element ``i`` of each."""
    for label, value in _labelled(args, kwargs):
        if not isinstance(value, list | tuple) or len(value) != world_size:
            got = f"length {len(value)}" if isinstance(value, list | tuple) else type(value).__name__
            raise ValueError(
                f"{label} must be a list of {world_size} per-rank values (one per worker), got {got}"
            )
    return _transpose(world_size, args, kwargs)


def split_dataprotos(world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Shards:
    """Pad every DataProto argument to a multiple of ``world_size`` (``pad_dataproto_to_divisor``) and give
    rank ``i`` chunk ``i``; other arguments go unchanged to every rank. Each DataProto of ``N`` rows gives
    every rank ``ceil(N / world_size)`` rows. They may differ in length (a batch plus a side batch, such as
    the SFT demonstrations of ``update_actor``, each shared out over the ranks); the result's rows follow
    the first DataProto argument, whose padding the collect function removes."""
    lengths = {label: len(v) for label, v in _labelled(args, kwargs) if isinstance(v, DataProto)}
    if not lengths:
        raise ValueError("DP_COMPUTE_PROTO / DP_COMPUTE_METRIC need at least one DataProto argument")

    def chunks(value: Any) -> list[Any]:
        if not isinstance(value, DataProto):
            return [value] * world_size
        return pad_dataproto_to_divisor(value, world_size)[0].chunk(world_size)

    shards = _transpose(world_size, tuple(chunks(a) for a in args), {k: chunks(v) for k, v in kwargs.items()})
    shards.pad_size = -next(iter(lengths.values())) % world_size
    return shards


def _labelled(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(f"argument {i}", a) for i, a in enumerate(args)] + [
        (f"argument {k!r}", v) for k, v in kwargs.items()
    ]


def _transpose(world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Shards:
    """Per-argument lists of per-rank values -> per-rank argument tuples/dicts."""
    return Shards(
        [tuple(a[r] for a in args) for r in range(world_size)],
        [{k: v[r] for k, v in kwargs.items()} for r in range(world_size)],
    )


def as_list(outputs: list[Any], shards: Shards) -> list[Any]:
    """Per-rank results, in rank order."""
    return list(outputs)


def first_output(outputs: list[Any], shards: Shards) -> Any:
    """Rank 0's result."""
    return outputs[0]


def concat_dataprotos(outputs: list[Any], shards: Shards) -> DataProto:
    """One DataProto: the ranks' results in rank order, without the rows the dispatch padded."""
    wrong = {rank: type(o).__name__ for rank, o in enumerate(outputs) if not isinstance(o, DataProto)}
    if wrong:
        raise TypeError(
            f"DP_COMPUTE_PROTO expects every worker to return a DataProto; got {wrong} (rank: type)"
        )
    return unpad_dataproto(DataProto.concat(outputs), shards.pad_size)


_MODES.update(
    {
        Dispatch.ONE_TO_ALL.value: DispatchMode(broadcast, as_list),
        Dispatch.ALL_TO_ALL.value: DispatchMode(split_lists, as_list),
        Dispatch.RANK_ZERO.value: DispatchMode(rank_zero_only, first_output),
        Dispatch.DP_COMPUTE.value: DispatchMode(split_lists, as_list),
        Dispatch.DP_COMPUTE_PROTO.value: DispatchMode(split_dataprotos, concat_dataprotos),
        Dispatch.DP_COMPUTE_METRIC.value: DispatchMode(split_dataprotos, as_list),
    }
)
