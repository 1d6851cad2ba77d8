"""The driver layer: ``PPOTrainer`` and its config, checkpoints, tracking and validation."""

from hybridflow.trainer.config import ConfigError, PPOConfig, load_config
from hybridflow.trainer.ppo import PPOTrainer

__all__ = ["ConfigError", "PPOConfig", "PPOTrainer", "load_config"]
