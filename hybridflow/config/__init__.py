"""Configuration: typed dataclasses with verl's key names, for every trainer, and their public names.

``from hybridflow.config import PPOConfig, load_config, ConfigError, ActorConfig, ...``: every section class
of the PPO schema is exported. The room holds, in import order: ``checks`` (the errors, value and
cross-field checks, the verl keys accepted with a warning), ``key_pairs`` (keys that have no effect without
another one), ``loader`` (YAML, ``a.b=c`` overrides and typing, keys that moved; generic: it takes the schema
as an argument), ``sections`` (what every trainer shares: run, optimiser, model loading, LoRA, FSDP, data
files), ``schema`` (PPO/GRPO), ``offline`` (SFT, DPO, KTO), ``docs`` (the ``#:`` docs, ``hybridflow config``,
the shipped YAML in ``yaml/``, generated from the schemas).

May import: ``utils``, ``protocol``, ``models``, ``algorithms``. The workers and trainers read these typed
sections, so configuration sits below them.
"""

from hybridflow.config.schema import (
    SECTION_CLASSES,
    ConfigError,
    DeprecatedKeyWarning,
    IgnoredKeyWarning,
    PPOConfig,
    UnusedKeyWarning,
    load_config,
)

globals().update(SECTION_CLASSES)  # DataConfig, ActorConfig, ... (found in the schema, not listed twice)

__all__ = [
    "ConfigError",
    "DeprecatedKeyWarning",
    "IgnoredKeyWarning",
    "PPOConfig",
    "UnusedKeyWarning",
    "load_config",
    *sorted(SECTION_CLASSES),
]
