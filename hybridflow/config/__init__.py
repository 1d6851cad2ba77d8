"""Configuration: typed dataclasses with verl's key names, for every trainer, and their public names.

``from hybridflow.config import PPOConfig, load_config, ConfigError, ActorConfig, ...``: every section class
of the PPO schema is exported. The room holds, in import order: ``checks`` (the errors, value and
cross-field checks, the verl keys accepted with a warning), ``key_pairs`` (keys that have no effect without
another one), ``loader`` (YAML, ``a.b=c`` overrides and typing, keys that moved; generic: it takes the schema
as an argument), ``sections`` (what every trainer shares: run, optimiser, model loading, LoRA, FSDP, data
files), ``reward_sections``, ``algorithm_sections`` and ``actor_sections`` (PPO's reward, algorithm, replay,
asynchronous and sandbox sections; the actor's policy loss, MoE routing replay, checkpoint contents), ``schema`` (PPO/GRPO, assembled from them), ``offline`` (SFT, DPO, KTO), ``docs`` (the
``#:`` docs, ``hybridflow config``, the shipped YAML in ``yaml/``, generated from the schemas).

May import: ``utils``, ``protocol``, ``models``, ``algorithms``. The workers and trainers read these typed
sections, so configuration sits below them.
"""

from hybridflow.config.schema import (
    ActorConfig,
    ActorRolloutRefConfig,
    AlgorithmConfig,
    AsyncTrainingConfig,
    CheckpointContentsConfig,
    CodeRewardConfig,
    ConfigError,
    CriticConfig,
    CriticModelConfig,
    CustomRewardFunctionConfig,
    DataConfig,
    DeprecatedKeyWarning,
    FilterGroupsConfig,
    IgnoredKeyWarning,
    JudgeConfig,
    KLControlConfig,
    ModelConfig,
    MultiTurnConfig,
    OverlongBufferConfig,
    PolicyLossConfig,
    PolicyModelConfig,
    PPOConfig,
    RefConfig,
    ReplayBufferConfig,
    ReplayScheduleEntry,
    RewardModelConfig,
    RewardModelPathConfig,
    RolloutConfig,
    RouterReplayConfig,
    SamplingConfig,
    SandboxConfig,
    ServedAgentConfig,
    SFTMixConfig,
    TeacherConfig,
    TwoStageRewardConfig,
    UnusedKeyWarning,
    load_config,
)
from hybridflow.config.sections import (
    DataFilesConfig,
    FSDPConfig,
    LoRAConfig,
    ModelLoadingConfig,
    OptimConfig,
    TrainerConfig,
    VisionTrainingConfig,
)

# every section class of the schema by name (tests/config/test_exports.py checks none is missing)
__all__ = [
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AlgorithmConfig",
    "AsyncTrainingConfig",
    "CheckpointContentsConfig",
    "CodeRewardConfig",
    "ConfigError",
    "CriticConfig",
    "CriticModelConfig",
    "CustomRewardFunctionConfig",
    "DataConfig",
    "DataFilesConfig",
    "DeprecatedKeyWarning",
    "FSDPConfig",
    "FilterGroupsConfig",
    "IgnoredKeyWarning",
    "JudgeConfig",
    "KLControlConfig",
    "LoRAConfig",
    "ModelConfig",
    "ModelLoadingConfig",
    "MultiTurnConfig",
    "OptimConfig",
    "OverlongBufferConfig",
    "PPOConfig",
    "PolicyLossConfig",
    "RouterReplayConfig",
    "PolicyModelConfig",
    "RefConfig",
    "ReplayBufferConfig",
    "ReplayScheduleEntry",
    "RewardModelConfig",
    "RewardModelPathConfig",
    "RolloutConfig",
    "SFTMixConfig",
    "SamplingConfig",
    "SandboxConfig",
    "ServedAgentConfig",
    "TeacherConfig",
    "TrainerConfig",
    "TwoStageRewardConfig",
    "UnusedKeyWarning",
    "VisionTrainingConfig",
    "load_config",
]
