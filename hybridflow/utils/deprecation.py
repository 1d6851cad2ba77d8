"""Public names that moved keep working for one release, with a ``DeprecationWarning`` naming the new path."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any


def moved_names(old: str, new: ModuleType, names: Iterable[str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the module ``old``: each of ``names`` resolves to ``new``'s, with a
    ``DeprecationWarning`` that names ``new``; any other name is an ``AttributeError`` as usual."""
    moved = frozenset(names)

    def __getattr__(name: str) -> Any:
        if name not in moved:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(
            f"{old}.{name} moved to {new.__name__}.{name}; the old path goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(new, name)

    return __getattr__
