"""Serving the policy over an OpenAI-compatible HTTP endpoint, and rollouts by agents that call it.

Holds the server (``PolicyServer``: aiohttp; chat and text completions, a token-in/token-out route, tool
calls, streaming, bearer-token auth), the batching of calls from many sessions into engine calls
(``batcher``), the per-session records of exactly what was sampled and the training rows built from
them (``sessions``), the served rollout mode (``ServedRollout``, ``SessionRewards``) and the
``hybridflow serve`` command (``command``).

Layering: above ``workers`` (it drives a rollout engine and reuses the chat-template check) and below
``trainer``, which wires the served rollout into a run; it imports ``utils``, ``protocol``, ``data``,
``rewards``, ``tools`` and ``workers`` only.
"""

from hybridflow.serving.batcher import Batcher, GenerationRequest
from hybridflow.serving.rollout import ServedRollout, SessionRewards
from hybridflow.serving.server import PolicyServer
from hybridflow.serving.sessions import CallRecord, sequences

__all__ = [
    "Batcher",
    "CallRecord",
    "GenerationRequest",
    "PolicyServer",
    "ServedRollout",
    "SessionRewards",
    "sequences",
]
