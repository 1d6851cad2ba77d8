"""The rollout contract: what every rollout engine and rollout mode is, and what they share.

``Rollout`` (a ``typing.Protocol``: ``generate_sequences`` plus declared ``Capabilities``), ``RolloutEngine``
and ``EngineSpec`` (an engine the registry builds, from what a worker holds), the registry
(``register_rollout``, ``rollout_class``, ``rollout_names``: the values ``actor_rollout_ref.rollout.name``
accepts), ``SamplingParams`` and ``SAMPLING_KEYS``, the batch layout every rollout returns
(``check_generation_batch``, ``assemble_rollout``, ``attach_responses``, ``response_mask_from``),
``WeightFeed`` and ``tag_weight_versions`` (the one writer of the per-token weight versions), a rollout's
own scores of its rows (``attach_scores``, ``rollout_scores``: a served agent's rewards), and
``chat_template`` (growing a conversation through the chat template token for token, which the agent loop
and the served sessions both do).

Why a room of its own: the engines (``workers.rollout``), the agent loop, the OpenAI-compatible server and the
served rollout (``serving``) all speak this contract; below all of them, each imports it and none imports the
others' files for it. May import: ``utils``, ``protocol``, ``algorithms``, ``config``.
"""

from hybridflow.rollout.contract import (
    SAMPLING_KEYS,
    Capabilities,
    EngineSpec,
    Rollout,
    RolloutEngine,
    SamplingParams,
    WeightFeed,
    assemble_rollout,
    attach_responses,
    attach_scores,
    check_generation_batch,
    is_tagged,
    response_mask_from,
    rollout_scores,
    tag_weight_versions,
)
from hybridflow.rollout.registry import register_rollout, rollout_class, rollout_names

__all__ = [
    "SAMPLING_KEYS",
    "Capabilities",
    "EngineSpec",
    "Rollout",
    "RolloutEngine",
    "SamplingParams",
    "WeightFeed",
    "assemble_rollout",
    "attach_responses",
    "attach_scores",
    "check_generation_batch",
    "is_tagged",
    "register_rollout",
    "response_mask_from",
    "rollout_class",
    "rollout_names",
    "rollout_scores",
    "tag_weight_versions",
]
