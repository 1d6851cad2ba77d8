"""The driver layer: ``PPOTrainer``, ``OfflineTrainer`` (SFT, DPO, KTO) and their configs, checkpoints,
tracking and validation.

The trainers are imported on first use, so tools that only need a checkpoint helper (such as
``hybridflow generate``) do not load the workers and Ray.
"""

from typing import Any

from hybridflow.config.offline import DPOConfig, KTOConfig, SFTConfig, load_offline_config
from hybridflow.config.schema import ConfigError, PPOConfig, load_config

__all__ = [
    "ConfigError",
    "DPOConfig",
    "KTOConfig",
    "OfflineTrainer",
    "PPOConfig",
    "PPOTrainer",
    "SFTConfig",
    "load_config",
    "load_offline_config",
]


def __getattr__(name: str) -> Any:
    if name == "PPOTrainer":
        from hybridflow.trainer.ppo import PPOTrainer

        return PPOTrainer
    if name == "OfflineTrainer":
        from hybridflow.trainer.offline import OfflineTrainer

        return OfflineTrainer
    raise AttributeError(f"module 'hybridflow.trainer' has no attribute {name!r}")
