"""Configurations of the offline trainers: ``SFTConfig``, ``DPOConfig``, ``KTOConfig``, ``RMConfig``.

verl's SFT key names where they exist (``data.train_files``, ``data.micro_batch_size_per_gpu``,
``data.max_length``, ``data.truncation``, ``model.partial_pretrain``, ``optim.lr``, ``optim.clip_grad``,
``trainer.total_epochs`` ...), TRL's names for the preference knobs (``dpo.beta``, ``dpo.loss_type``,
``dpo.label_smoothing``, ``kto.desirable_weight`` ...). The data files, model loading, LoRA, optimiser and
trainer sections are the ones every trainer shares (``sections.py``), and loading goes through the same
generic loader (``load_offline_config``), so every mistake fails at load time naming the key.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from hybridflow.config.checks import ConfigError
from hybridflow.config.key_pairs import OFFLINE_KEY_PAIRS, check_key_pairs
from hybridflow.config.loader import Schema, load
from hybridflow.config.sections import (
    YAML_DIR,
    DataFilesConfig,
    FSDPConfig,
    LoRAConfig,
    ModelLoadingConfig,
    OptimConfig,
    TrainerConfig,
    VisionTrainingConfig,
    resolve_shared,
)


@dataclass
class OfflineDataConfig(DataFilesConfig):
    """Data files and batch sizes shared by the offline trainers."""

    micro_batch_size_per_gpu: int = 4  #: rows per forward/backward on one worker (gradient accumulation)
    max_length: int = 1024  #: most prompt + response tokens per sample


@dataclass
class SFTDataConfig(OfflineDataConfig):
    """Demonstrations: ``{prompt, response}`` rows or ``{messages}`` conversations."""

    response_key: str = "response"  #: column holding the target response (string or assistant messages)
    messages_key: str = "messages"  #: column holding a whole conversation; loss on assistant turns only
    #: micro-batches filled to max_token_len_per_gpu real tokens (rows of similar length together, little
    #: padding) instead of micro_batch_size_per_gpu rows; the update is the same, the cost follows the tokens
    use_dynamic_bsz: bool = False
    max_token_len_per_gpu: int = 8192  #: real tokens per micro-batch when use_dynamic_bsz


@dataclass
class PreferenceDataConfig(OfflineDataConfig):
    """Preference pairs ``{prompt, chosen, rejected}`` (TRL's format)."""

    chosen_key: str = "chosen"  #: column holding the preferred completion
    rejected_key: str = "rejected"  #: column holding the dispreferred completion


@dataclass
class RewardPairDataConfig(PreferenceDataConfig):
    """Preference pairs for a reward model: ``{prompt, chosen, rejected}`` and TRL's optional ``margin``."""

    margin_key: str = "margin"  #: column with each pair's margin (TRL's); a file without it uses 0
    #: micro-batches filled to max_token_len_per_gpu real tokens (whole pairs, similar lengths together)
    #: instead of micro_batch_size_per_gpu pairs; the update is the same, the cost follows the tokens
    use_dynamic_bsz: bool = False
    max_token_len_per_gpu: int = 8192  #: real tokens per micro-batch when use_dynamic_bsz (>= a whole pair)


@dataclass
class KTODataConfig(OfflineDataConfig):
    """Unpaired completions ``{prompt, completion, label}`` (TRL's format)."""

    completion_key: str = "completion"  #: column holding the completion
    label_key: str = "label"  #: column holding true (desirable) or false (undesirable)


@dataclass
class _StartingModel(ModelLoadingConfig):
    """The starting model: a Hugging Face folder, a checkpoint's ``actor/huggingface`` folder, or ``default``."""

    #: model folder or hub id; "default" = the embedded SmolLM2-135M-Instruct
    partial_pretrain: str = "default"


@dataclass
class OfflineModelConfig(VisionTrainingConfig, LoRAConfig, _StartingModel):
    """The starting model, optionally trained through LoRA adapters (verl SFT's ``model.lora_rank`` ...); DPO
    and KTO then take their reference log-probs from the same module with the adapter off."""


@dataclass
class RewardModelStartConfig(OfflineModelConfig):
    """The reward model's starting point: any causal LM (a fresh one-output score head is added) or a
    sequence-classification checkpoint; trained in full, or through LoRA adapters (the head always trains)."""

    strategy: Literal["ddp", "fsdp2"] = "ddp"  #: full replicas (ddp) or FSDP2 shards over trainer.n_workers
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)  #: FSDP2 settings when strategy is fsdp2


@dataclass
class OfflineOptimConfig(OptimConfig):
    """AdamW as in the PPO config, plus verl SFT's gradient clipping key."""

    lr: float = 1e-5  #: learning rate
    clip_grad: float = 1.0  #: max gradient norm


@dataclass
class DPOLossConfig:
    """The preference loss (TRL's names)."""

    beta: float = 0.1  #: strength of the implicit KL to the reference (IPO: its tau)
    loss_type: str = "sigmoid"  #: sigmoid (DPO) | ipo | hinge | your own (register_preference_loss)
    label_smoothing: float = 0.0  #: share of preference labels taken as flipped (cDPO); sigmoid only


@dataclass
class KTOLossConfig:
    """KTO's knobs (TRL's names)."""

    beta: float = 0.1  #: strength of the implicit KL to the reference
    desirable_weight: float = 1.0  #: weight of desirable rows' losses (raise it when they are rarer)
    undesirable_weight: float = 1.0  #: weight of undesirable rows' losses


@dataclass
class RewardLossConfig:
    """The Bradley-Terry loss (TRL's names)."""

    #: adds coefficient x mean((r_chosen + r_rejected)^2), centring rewards on 0; null = off
    center_rewards_coefficient: float | None = None


C = TypeVar("C", bound="_OfflineConfig")


@dataclass
class _OfflineConfig(Schema):
    """What the three configs share: loading, resolving, validating."""

    model: OfflineModelConfig = field(default_factory=OfflineModelConfig)  #: the model trained
    optim: OfflineOptimConfig = field(default_factory=OfflineOptimConfig)  #: its optimizer
    #: the run: length, logging, workers, checkpoints (PPO's trainer section)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    #: the data files and batch sizes (each config narrows it to its own section, in the same place)
    data: OfflineDataConfig = field(default_factory=OfflineDataConfig)

    ALIASES: ClassVar[dict[str, str]] = {
        "output_dir": "trainer.default_local_dir",
        "max_steps": "trainer.total_training_steps",
        "num_train_epochs": "trainer.total_epochs",
        "learning_rate": "optim.lr",
        "max_grad_norm": "optim.clip_grad",
        "warmup_ratio": "optim.lr_warmup_steps_ratio",
        "per_device_train_batch_size": "data.micro_batch_size_per_gpu",
        "model_name_or_path": "model.partial_pretrain",
        "gradient_checkpointing": "model.enable_gradient_checkpointing",
    }

    def resolve(self: C) -> C:
        """A copy with derived values filled (``resolve_shared``), ``${...}`` interpolations resolved."""
        cfg = type(self).from_dict(self.to_dict())
        paths = [(cfg.model, "partial_pretrain"), (cfg.data, "train_files"), (cfg.data, "val_files")]
        paths += [(cfg.trainer, "default_local_dir"), (cfg.trainer, "resume_from_path")]
        resolve_shared(cfg, [cfg.model], paths)
        return cfg

    def validate(self: C) -> C:
        """The resolved config, checked: a ConfigError names the first inconsistent key."""
        cfg = self.resolve()
        d, tr = cfg.data, cfg.trainer
        if not d.train_files:
            raise ConfigError(
                "data.train_files is required: the training file(s), e.g. data.train_files=train.parquet"
            )
        for key in ("train_batch_size", "micro_batch_size_per_gpu", "max_length"):
            if getattr(d, key) < 1:
                raise ConfigError(f"data.{key} must be >= 1, got {getattr(d, key)}")
        if cfg.model.lora_rank < 0 or cfg.model.lora_alpha <= 0:
            raise ConfigError(
                f"model.lora_rank must be >= 0 and model.lora_alpha > 0, got {cfg.model.lora_rank} "
                f"and {cfg.model.lora_alpha}"
            )
        if d.train_batch_size % tr.n_workers:
            raise ConfigError(
                f"data.train_batch_size ({d.train_batch_size}) does not divide evenly across "
                f"trainer.n_workers ({tr.n_workers})"
            )
        if self.kind == "kto" and d.train_batch_size // tr.n_workers < 2:
            raise ConfigError(
                "KTO estimates its KL reference point from mismatched pairs within a batch: "
                "data.train_batch_size / trainer.n_workers must be >= 2"
            )
        if cfg.optim.lr <= 0 or tr.total_epochs < 1:
            raise ConfigError(
                f"optim.lr must be > 0 and trainer.total_epochs >= 1, got {cfg.optim.lr} and "
                f"{tr.total_epochs}"
            )
        self._validate_loss(cfg)
        check_key_pairs(cfg, type(self)(), OFFLINE_KEY_PAIRS)
        return cfg

    def _validate_loss(self, cfg: Any) -> None:
        """Checks of the objective's own keys."""

    def loss_spec(self) -> dict[str, Any]:
        """What the actor's offline update needs to know: the objective's name and settings."""
        return {"loss": self.kind}


@dataclass
class SFTConfig(_OfflineConfig):
    """Supervised fine-tuning: ``hybridflow sft``; ``SFTConfig()`` is complete but for data.train_files."""

    data: SFTDataConfig = field(default_factory=SFTDataConfig)  #: demonstrations and batch sizes

    kind = "sft"

    def _validate_loss(self, cfg: Any) -> None:
        if cfg.data.max_token_len_per_gpu < 1:
            raise ConfigError(
                f"data.max_token_len_per_gpu must be >= 1, got {cfg.data.max_token_len_per_gpu}"
            )


@dataclass
class DPOConfig(_OfflineConfig):
    """Direct preference optimisation: ``hybridflow dpo``."""

    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)  #: preference pairs, batch sizes
    dpo: DPOLossConfig = field(default_factory=DPOLossConfig)  #: the DPO-family loss

    kind = "dpo"

    def _validate_loss(self, cfg: Any) -> None:
        from hybridflow.algorithms import get_preference_loss_fn

        try:
            get_preference_loss_fn(cfg.dpo.loss_type)
        except ValueError as err:
            raise ConfigError(f"dpo.loss_type: {err}") from None
        if cfg.dpo.beta <= 0 or not 0 <= cfg.dpo.label_smoothing < 0.5:
            raise ConfigError(
                f"dpo.beta must be > 0 and dpo.label_smoothing in [0, 0.5), got {cfg.dpo.beta} "
                f"and {cfg.dpo.label_smoothing}"
            )
        if cfg.dpo.label_smoothing and cfg.dpo.loss_type != "sigmoid":
            raise ConfigError(
                f"dpo.label_smoothing only applies to dpo.loss_type=sigmoid, not {cfg.dpo.loss_type}"
            )

    def loss_spec(self) -> dict[str, Any]:
        return {"loss": "dpo", **dataclasses.asdict(self.dpo)}


@dataclass
class KTOConfig(_OfflineConfig):
    """Kahneman-Tversky optimisation on unpaired good/bad completions: ``hybridflow kto``."""

    data: KTODataConfig = field(default_factory=KTODataConfig)  #: labelled completions, batch sizes
    kto: KTOLossConfig = field(default_factory=KTOLossConfig)  #: the KTO loss

    kind = "kto"

    def _validate_loss(self, cfg: Any) -> None:
        k = cfg.kto
        if k.beta <= 0 or k.desirable_weight <= 0 or k.undesirable_weight <= 0:
            raise ConfigError(
                f"kto.beta, kto.desirable_weight and kto.undesirable_weight must be > 0, got "
                f"{k.beta}, {k.desirable_weight}, {k.undesirable_weight}"
            )

    def loss_spec(self) -> dict[str, Any]:
        return {"loss": "kto", **dataclasses.asdict(self.kto)}


@dataclass
class RMConfig(_OfflineConfig):
    """Reward-model training on preference pairs (Bradley-Terry): ``hybridflow rm``. The checkpoint's
    ``reward_model/huggingface`` folder is an ``AutoModelForSequenceClassification`` that PPO's
    ``reward_model.model.path`` loads as it is."""

    data: RewardPairDataConfig = field(default_factory=RewardPairDataConfig)  #: preference pairs, batch sizes
    model: RewardModelStartConfig = field(default_factory=RewardModelStartConfig)  #: the model trained
    rm: RewardLossConfig = field(default_factory=RewardLossConfig)  #: the reward model's loss

    kind = "rm"

    def _validate_loss(self, cfg: Any) -> None:
        coefficient = cfg.rm.center_rewards_coefficient
        if coefficient is not None and coefficient < 0:
            raise ConfigError(f"rm.center_rewards_coefficient must be >= 0 (or null), got {coefficient}")
        if cfg.data.use_dynamic_bsz and cfg.data.max_token_len_per_gpu < 2 * cfg.data.max_length:
            raise ConfigError(
                f"data.max_token_len_per_gpu ({cfg.data.max_token_len_per_gpu}) must hold a whole pair: at least "
                f"2 x data.max_length = {2 * cfg.data.max_length}"
            )

    def loss_spec(self) -> dict[str, Any]:
        return {"loss": "rm", **dataclasses.asdict(self.rm)}


OfflineConfig = SFTConfig | DPOConfig | KTOConfig | RMConfig

CONFIGS: dict[str, type[SFTConfig] | type[DPOConfig] | type[KTOConfig] | type[RMConfig]] = {
    "sft": SFTConfig,
    "dpo": DPOConfig,
    "kto": KTOConfig,
    "rm": RMConfig,
}


def default_config_path(cls: type[_OfflineConfig]) -> Path:
    """The packaged YAML of a trainer: ``config/{sft,dpo,kto,rm}_trainer.yaml``."""
    return YAML_DIR / f"{cls.kind}_trainer.yaml"


def load_offline_config(
    cls: type[C], overrides: list[str] | None = None, config_path: str | os.PathLike[str] | None = None
) -> C:
    """The defaults of ``cls`` (what its packaged YAML holds), a user YAML merged over them, then dotted
    overrides; resolved, validated. Same syntax as ``load_config`` for PPO."""
    return load(cls, overrides, config_path).validate()
