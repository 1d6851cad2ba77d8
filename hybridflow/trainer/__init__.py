"""The trainers: the one run loop (``loop.py``), ``PPOTrainer`` (``ppo.py``: the driver, one screen per step),
``OfflineTrainer`` (``offline.py``: SFT, DPO, KTO), worker-group assembly and placement (``worker_groups.py``),
metrics and validation, replay and the two-stage reward in the driver, dynamic sampling
(``dynamic_sampling.py``), overlong shaping and the distillation teacher (``shaping.py``), and the ``main_*``
entry points.

May import every room before it (``workers``, ``data``, ``runs``, ``config``...); only ``commands`` imports it.

The trainers are imported on first use, so ``from hybridflow.trainer import PPOConfig`` does not load the
workers and Ray.
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
