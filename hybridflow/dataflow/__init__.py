"""Reusable pieces for custom RL dataflows, written as plain driver code around ``DataProto``.

* ``ReplayBuffer`` / ``ScheduledSampler``: keep rows across steps; sample uniformly or by priority.
* ``DataFlow`` / ``Router``: route each row down its own path and merge the rows back in order.
* ``TwoStageReward``: a cheap scorer on every row, an expensive one only on each group's best rows.

It works in any driver, trainer or not.

May import: ``utils``, ``protocol``, ``models``, ``algorithms``. It sits below ``config``, whose checks ask the
replay sampler whether its settings are valid.
"""

from hybridflow.algorithms import sequence_to_token_scores  # re-exported: scorers here return (bs,) scores
from hybridflow.dataflow.graph import DEFAULT_ROUTE, DataFlow, Router
from hybridflow.dataflow.replay_buffer import (
    ReplayBuffer,
    ScheduledSampler,
    importance_weights,
    priority_probabilities,
)
from hybridflow.dataflow.two_stage import TwoStageReward, top_k_per_group

__all__ = [
    "DEFAULT_ROUTE",
    "DataFlow",
    "ReplayBuffer",
    "Router",
    "ScheduledSampler",
    "TwoStageReward",
    "importance_weights",
    "priority_probabilities",
    "sequence_to_token_scores",
    "top_k_per_group",
]
