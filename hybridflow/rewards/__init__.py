"""Rewards: rule scorers chosen by data_source (code run against its tests among them), user reward files,
and the manager that applies them.

May import: ``utils``, ``protocol``, ``models``, ``algorithms``, ``dataflow``, ``config``, ``single_controller``,
``tools`` (the code scorer runs programs in the python tool's sandbox), ``runs``.
"""

from hybridflow.rewards.code import CODE_SOURCES, CodeScorer
from hybridflow.rewards.manager import RewardManager
from hybridflow.rewards.registry import (
    RULE_SCORERS,
    BatchScorer,
    RuleScorers,
    default_compute_score,
    load_custom_reward_function,
)

__all__ = [
    "CODE_SOURCES",
    "RULE_SCORERS",
    "BatchScorer",
    "CodeScorer",
    "RewardManager",
    "RuleScorers",
    "default_compute_score",
    "load_custom_reward_function",
]
