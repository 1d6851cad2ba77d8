"""Rewards: rule scorers chosen by data_source, user reward files, and the manager that applies them.

May import: ``utils``, ``protocol``, ``models``, ``algorithms``, ``dataflow``, ``config``.
"""

from hybridflow.rewards.manager import RewardManager
from hybridflow.rewards.registry import RULE_SCORERS, default_compute_score, load_custom_reward_function

__all__ = ["RULE_SCORERS", "RewardManager", "default_compute_score", "load_custom_reward_function"]
