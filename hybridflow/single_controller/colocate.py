"""Colocation: several roles' workers in one process per rank (the hybrid engine).

``create_colocated_worker_cls({"actor": ClassWithInitArgs(A), "critic": ClassWithInitArgs(C)})`` builds a
fused ``Worker`` class whose instance holds one worker per role, built in the same process, so roles share
devices and memory instead of each taking its own. Every registered method ``m`` of role ``r`` becomes
the fused method ``r__m`` with the same registration; ``WorkerGroup.spawn`` turns a group of the fused
class back into one group per role, with the role's own method names. Nothing here depends on how the
workers are run, so local and Ray groups share this code path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any

from hybridflow.single_controller.decorator import registered_methods
from hybridflow.single_controller.worker import ClassWithInitArgs, Worker

ROLE_METHODS_ATTR = "__hybridflow_role_methods__"  # {role: {method: fused method name}}
SEPARATOR = "__"


def create_colocated_worker_cls(
    role_inits: Mapping[str, ClassWithInitArgs[Any]],
) -> ClassWithInitArgs[Any]:
    """A deferred constructor of one fused worker class holding a worker per role.

    Role names may be strings or (str) enums; they must not contain ``"__"``. Each role class must be a
    ``Worker`` subclass (it reads its rank from the same environment as the fused worker).
    """
    if not role_inits:
        raise ValueError("create_colocated_worker_cls needs at least one role")
    inits = {_role_name(role): init for role, init in role_inits.items()}
    namespace: dict[str, Any] = {"__init__": _init_roles, "__module__": __name__}
    role_methods: dict[str, dict[str, str]] = {}
    for role, init in inits.items():
        if SEPARATOR in role:
            raise ValueError(f"role name {role!r} must not contain {SEPARATOR!r}")
        if not isinstance(init, ClassWithInitArgs) or not issubclass(init.cls, Worker):
            raise TypeError(f"role {role!r} needs a ClassWithInitArgs of a Worker subclass, got {init!r}")
        role_methods[role] = {}
        for method in registered_methods(init.cls):
            fused = f"{role}{SEPARATOR}{method}"
            namespace[fused] = _forwarder(role, method, getattr(init.cls, method))
            role_methods[role][method] = fused
    namespace[ROLE_METHODS_ATTR] = role_methods
    name = "Colocated_" + "_".join(f"{role}_{init.cls.__name__}" for role, init in inits.items())
    namespace["__qualname__"] = name  # not reachable by import: Ray pickles the class by value
    return ClassWithInitArgs(type(name, (_Colocated,), namespace), inits)


class _Colocated(Worker):
    """The base of every fused class: a worker holding one worker per role."""

    role_workers: dict[str, Worker]


def _init_roles(self: _Colocated, role_inits: dict[str, ClassWithInitArgs[Any]]) -> None:
    """``__init__`` of fused classes: every role's worker, built in this process, in the given order."""
    Worker.__init__(self)
    self.role_workers = {role: init() for role, init in role_inits.items()}


def _forwarder(role: str, method: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """The fused method ``role__method``: calls ``method`` on the role's worker; same registration."""

    @functools.wraps(original)  # keeps the docstring, the signature (via __wrapped__) and the @register spec
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.role_workers[role], method)(*args, **kwargs)

    return forward


def _role_name(role: str | Enum) -> str:
    return str(role.value) if isinstance(role, Enum) else str(role)
