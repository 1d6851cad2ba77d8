"""Workers: the heavy state (models, optimisers, rollout engines) that worker groups drive.

``ActorRolloutRefWorker`` (policy: actor / rollout / reference in any combination), ``CriticWorker``
(value model), ``RewardModelWorker`` (a sequence-classification reward model, or a dummy one) and
``RewardWorker`` (the rule-based or custom reward function, in its own process).

May import: every room before it (``config`` for their typed sections: ``ActorRolloutRefConfig``,
``CriticConfig``, ``RolloutConfig``...; ``single_controller``, ``tools``, ``data``, ``rewards``...; ``rollout``,
the contract their engines implement; ``serving``, whose served rollout they build over their engine); never
the trainers or commands.
"""

from hybridflow.workers.actor import ActorRolloutRefWorker
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.reward import RewardWorker
from hybridflow.workers.reward_model import RewardModelWorker

__all__ = ["ActorRolloutRefWorker", "CriticWorker", "RewardModelWorker", "RewardWorker"]
