"""The roles a dataflow's worker groups play, for mapping roles to resource pools.

A str enum: ``Role.CRITIC == "critic"`` and both hash alike, so dicts keyed by roles accept either.
"""

from __future__ import annotations

from enum import Enum


class Role(str, Enum):
    ACTOR_ROLLOUT = "actor_rollout"  # policy training and generation (the hybrid engine)
    CRITIC = "critic"
    REF = "ref"  # frozen reference policy for the KL term
    REWARD_MODEL = "reward_model"

    def __str__(self) -> str:
        return self.value
