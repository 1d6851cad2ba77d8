"""The trainer configuration's public names in one short import: ``from hybridflow.config import ...``.

``PPOConfig``, ``load_config``, ``ConfigError`` and every section class of the schema (``DataConfig``,
``ActorConfig``, ``OptimConfig``, ...). The schema itself lives in ``hybridflow/trainer/config.py``.
"""

from hybridflow.trainer.config import (
    SECTION_CLASSES,
    ConfigError,
    IgnoredKeyWarning,
    PPOConfig,
    load_config,
)

globals().update(SECTION_CLASSES)  # DataConfig, ActorConfig, ... (found in the schema, not listed twice)

__all__ = ["ConfigError", "IgnoredKeyWarning", "PPOConfig", "load_config", *sorted(SECTION_CLASSES)]
