"""A name -> function registry, shared by advantage estimators, policy losses and KL estimators.

Why one class: every pluggable piece of the algorithm library is chosen by a string in the config,
so they all need the same three behaviours: register under a name with a decorator, refuse to silently
replace an existing entry, and fail on an unknown name with a message that lists the valid choices.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Functions registered under string names; ``kind`` names the registry in error messages."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._fns: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator registering ``fn`` under ``name`` and returning it unchanged.

        Registering the same function again is allowed (a re-imported or reloaded module defines an
        equal function with the same module and qualified name); a different function under a taken
        name is a ValueError, because silently replacing e.g. "grpo" would change training behaviour.
        """

        def decorator(fn: F) -> F:
            existing = self._fns.get(name)
            if existing is not None and not _same_function(existing, fn):
                raise ValueError(
                    f"{self.kind} {name!r} is already registered to "
                    f"{existing.__module__}.{existing.__qualname__}; "
                    f"cannot register {fn.__module__}.{fn.__qualname__} under the same name"
                )
            self._fns[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        """The function registered as ``name``; ValueError listing the known names otherwise."""
        try:
            return self._fns[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {self.names()}") from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._fns)


def _same_function(a: Callable, b: Callable) -> bool:
    return a is b or (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)
