"""Rollout engines by name: ``actor_rollout_ref.rollout.name`` is one of the names registered here.

A new engine is one file and one registration::

    from hybridflow.rollout import Capabilities, Rollout, register_rollout

    @register_rollout("mine")
    class MyRollout(Rollout):
        capabilities = Capabilities(own_weights=True)  # what it declares beyond generating

        @classmethod
        def from_spec(cls, spec):  # an EngineSpec: the rollout config, the actor's module, tokenizer...
            ...

        def generate_sequences(self, prompts):  # the batch layout of contract.attach_responses
            ...

The registry sits below the workers and the serving room (which drive any engine) and knows no engine
itself: the built-in ``hf`` and ``vllm`` register where they are defined (``hybridflow.workers.rollout``,
which every worker and trainer imports), as a user's engine registers in its own module. The trainer
checks the name on the driver before any worker starts, and hands the class to the workers, so an engine
registered in the driver's script is built in Ray's worker processes too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from hybridflow.config import ConfigError
from hybridflow.rollout.contract import RolloutEngine

KEY = "actor_rollout_ref.rollout.name"
Engine = TypeVar("Engine", bound=type[RolloutEngine])
_ENGINES: dict[str, type[RolloutEngine]] = {}


def register_rollout(name: str) -> Callable[[Engine], Engine]:
    """Class decorator: the engine ``rollout.name=<name>`` builds (``cls.from_spec(spec)``). A second class
    under a taken name is refused (the same class defined again, as a reloaded module does, replaces it)."""

    def register(cls: Engine) -> Engine:
        """Put ``cls`` in the table under ``name``."""
        known = _ENGINES.get(name)
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(
                f"rollout engine {name!r} is registered already ({known.__module__}.{known.__qualname__}); "
                "register yours under another name"
            )
        _ENGINES[name] = cls
        return cls

    return register


def rollout_names() -> list[str]:
    """The registered engine names, sorted: the values ``actor_rollout_ref.rollout.name`` accepts."""
    return sorted(_ENGINES)


def rollout_class(name: str) -> type[RolloutEngine]:
    """The engine registered as ``name``; a ``ConfigError`` naming the key and the registered names if none."""
    engine = _ENGINES.get(name)
    if engine is None:
        raise ConfigError(
            f"{KEY}: no rollout engine {name!r} is registered; registered: {', '.join(rollout_names())} "
            "(add one with hybridflow.rollout.register_rollout)"
        )
    return engine
