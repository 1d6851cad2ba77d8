"""Serving a rollout engine over an OpenAI-compatible HTTP endpoint, and the rollout mode in which agents call it.

Holds the server (``PolicyServer``: aiohttp; chat and text completions, a token-in/token-out route, tool
calls, streaming, bearer-token auth), OpenAI's wire format (``openai_format``), the batching of calls from
many sessions into engine calls (``batcher``), the per-session records of exactly what was sampled and the
training rows built from them (``sessions``), and the served rollout (``ServedRollout``: a ``Rollout`` whose
samples an ``openai``-SDK agent makes, scored by the agent's own return value).

Layering: it speaks only the rollout contract (``hybridflow.rollout``), so it sits below ``workers``, which
build the served rollout over their engine like any other rollout mode (``build_rollout``); ``hybridflow
serve`` (``commands/serve.py``) loads a checkpoint and hands its engine in. It imports ``utils``,
``protocol``, ``config``, ``rollout``, ``rewards`` (the one rule for scores), ``tools`` (the tool-call parser)
and ``data`` only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridflow.serving.batcher import Batcher, GenerationRequest
from hybridflow.serving.rollout import ServedRollout, agent_sample
from hybridflow.serving.sessions import CallRecord, sequences

if TYPE_CHECKING:
    from hybridflow.serving.server import PolicyServer

__all__ = [
    "Batcher",
    "CallRecord",
    "GenerationRequest",
    "PolicyServer",
    "ServedRollout",
    "agent_sample",
    "sequences",
]


def __getattr__(name: str) -> type:
    """``PolicyServer`` on first use: every worker process imports this package (the served rollout is a rollout
    mode), and only those that serve should load aiohttp (~8 MiB each)."""
    if name == "PolicyServer":
        from hybridflow.serving.server import PolicyServer

        return PolicyServer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
