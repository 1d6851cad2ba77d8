"""The driver layer: ``PPOTrainer`` and its config, checkpoints, tracking and validation.

``PPOTrainer`` is imported on first use, so tools that only need a checkpoint helper (such as
``hybridflow generate``) do not load the workers and Ray.
"""

from typing import Any

from hybridflow.trainer.config import ConfigError, PPOConfig, load_config

__all__ = ["ConfigError", "PPOConfig", "PPOTrainer", "load_config"]


def __getattr__(name: str) -> Any:
    if name == "PPOTrainer":
        from hybridflow.trainer.ppo import PPOTrainer

        return PPOTrainer
    raise AttributeError(f"module 'hybridflow.trainer' has no attribute {name!r}")
