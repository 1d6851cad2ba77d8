"""A name -> function registry, shared by advantage estimators, policy losses and KL estimators.

Why one class: every pluggable piece of the algorithm library is chosen by a string in the config,
so they all need the same behaviours: register under a name (or an Enum member, whose value is the name)
with a decorator, fail on an unknown name with a message that lists the valid choices, and expose the
entries as a plain dict under verl's name (``ADV_ESTIMATOR_REGISTRY``, ``POLICY_LOSS_REGISTRY``), live:
what code puts into that dict is registered.

A second function under a taken name follows verl, per registry: estimators refuse it (ValueError), policy
losses replace the old one (verl does so silently; here a ``UserWarning`` names both functions).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from enum import Enum
from typing import Any, Generic, Literal, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
Name = str | Enum


def name_of(name: Name) -> str:
    """The registry key of ``name``: an Enum member's value, else the string itself."""
    return name.value if isinstance(name, Enum) else name


class Registry(Generic[F]):
    """Functions registered under string names; ``kind`` names the registry in error messages;
    ``on_conflict`` says what a different function under a taken name does."""

    def __init__(self, kind: str, on_conflict: Literal["error", "replace"] = "error") -> None:
        self.kind = kind
        self.on_conflict = on_conflict
        self.entries: dict[str, F] = {}

    def register(self, name: Name, adapt: Callable[[F], F] | None = None) -> Callable[[F], F]:
        """Decorator registering ``fn`` (or ``adapt(fn)``) under ``name`` and returning ``fn`` unchanged.

        Registering the same function again is allowed (a re-imported or reloaded module defines an
        equal function with the same module and qualified name).
        """
        key = name_of(name)

        def decorator(fn: F) -> F:
            existing = self.entries.get(key)
            if existing is not None and not _same_function(existing, fn):
                described = (
                    f"{self.kind} {key!r} is already registered to {_describe(existing)}; "
                    f"{_describe(fn)} registered under the same name"
                )
                if self.on_conflict == "error":
                    raise ValueError(f"{described} is refused (pick another name)")
                warnings.warn(f"{described} replaces it", UserWarning, stacklevel=2)
            self.entries[key] = adapt(fn) if adapt is not None else fn
            return fn

        return decorator

    def get(self, name: Name) -> F:
        """The function registered as ``name``; ValueError listing the known names otherwise."""
        try:
            return self.entries[name_of(name)]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name_of(name)!r}; known: {self.names()}") from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self.entries)


def _describe(fn: Callable[..., Any]) -> str:
    original = getattr(fn, "__wrapped__", fn)
    return f"{getattr(original, '__module__', '?')}.{getattr(original, '__qualname__', repr(original))}"


def _same_function(a: Callable[..., Any], b: Callable[..., Any]) -> bool:
    a = getattr(a, "__wrapped__", a)
    return a is b or (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)
