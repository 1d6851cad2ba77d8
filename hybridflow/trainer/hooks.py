"""Callbacks on training events: user code that reads the step's metrics and batch and may act.

A hook is ``fn(trainer, step, metrics, batch)``; it may call trainer methods such as ``adapt_lr``. A hook
that raises stops the run with a ``HookError`` naming the hook and the event; hooks run where the
trainer's state is consistent (between stages), so the last complete checkpoint stays valid.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

EVENTS = (
    "on_fit_start",
    "on_step_start",
    "after_generate",
    "after_reward",
    "after_advantage",
    "on_step_end",
    "on_validation_end",
    "on_checkpoint",
    "on_fit_end",
)
ALIASES = {"on_batch_end": "on_step_end"}

Hook = Callable[[Any, int, dict, Any], None]


class HookError(RuntimeError):
    """A user hook raised; the message names the hook, the event and the step."""


class HookRegistry:
    def __init__(self) -> None:
        self._hooks: dict[str, list[Hook]] = {event: [] for event in EVENTS}

    def register(self, event: str, fn: Hook) -> None:
        event = ALIASES.get(event, event)
        if event not in self._hooks:
            raise ValueError(f"unknown hook event {event!r}; known: {', '.join(EVENTS + tuple(ALIASES))}")
        if not callable(fn):
            raise TypeError(f"hook for {event!r} must be callable, got {fn!r}")
        self._hooks[event].append(fn)

    def emit(self, event: str, trainer: Any, step: int, metrics: dict, batch: Any = None) -> None:
        for fn in self._hooks[event]:
            try:
                fn(trainer, step, metrics, batch)
            except Exception as e:
                name = getattr(fn, "__qualname__", repr(fn))
                raise HookError(f"hook {name!r} on {event!r} raised at step {step}: {e!r}") from e
