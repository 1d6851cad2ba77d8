"""Configurations of the offline trainers: ``SFTConfig``, ``DPOConfig``, ``KTOConfig``.

verl's SFT key names where they exist (``data.train_files``, ``data.micro_batch_size_per_gpu``,
``data.max_length``, ``data.truncation``, ``model.partial_pretrain``, ``optim.lr``, ``optim.clip_grad``,
``trainer.total_epochs`` ...), TRL's names for the preference knobs (``dpo.beta``, ``dpo.loss_type``,
``dpo.label_smoothing``, ``kto.desirable_weight`` ...). The optimiser and trainer sections are the PPO
config's own classes, and loading goes through the same merge/override/typing machinery
(``load_offline_config``), so every mistake fails at load time naming the key.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from hybridflow.trainer import config_loader as base
from hybridflow.trainer.config import ConfigError, Dtype, LoRAConfig, OptimConfig, TrainerConfig
from hybridflow.trainer.config_checks import DTYPE_ALIASES, cuda_available

CONFIG_DIR = Path(__file__).parent / "config"


@dataclass
class OfflineDataConfig:
    """Data files and batch sizes shared by the offline trainers."""

    train_files: list[str] | None = None  #: required: training file(s), parquet or JSONL
    val_files: list[str] | None = None  #: held-out file(s) for the validation loss; null = none
    prompt_key: str = "prompt"  #: column holding the prompt (a string or chat messages)
    #: render prompts and completions with the tokenizer's chat template (a string prompt is one user turn);
    #: false = strings fed as they are (pre-rendered text, base models without a template): prompt ids are the
    #: tokenizer's plain output, the completion's get EOS appended
    apply_chat_template: bool = True
    train_batch_size: int = 8  #: rows per optimiser step (DPO: pairs; KTO: completions)
    micro_batch_size_per_gpu: int = 4  #: rows per forward/backward on one worker (gradient accumulation)
    max_length: int = 1024  #: most prompt + response tokens per sample
    truncation: Literal["error", "left", "right"] = "error"  #: over max_length: error | left (prompt) | right
    shuffle: bool = True  #: shuffle the training rows each epoch
    seed: int | None = None  #: data order seed; null = trainer.seed


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
class KTODataConfig(OfflineDataConfig):
    """Unpaired completions ``{prompt, completion, label}`` (TRL's format)."""

    completion_key: str = "completion"  #: column holding the completion
    label_key: str = "label"  #: column holding true (desirable) or false (undesirable)


@dataclass
class _StartingModel:
    """The starting model: a Hugging Face folder, a checkpoint's ``actor/huggingface`` folder, or ``default``."""

    partial_pretrain: str = (
        "default"  #: model folder or hub id; "default" = the embedded SmolLM2-135M-Instruct
    )
    trust_remote_code: bool = False  #: allow model code shipped with the checkpoint
    enable_gradient_checkpointing: bool = False  #: recompute activations in backward: less memory, slower
    dtype: Dtype = "auto"  #: auto (fp32 on cpu, bf16 on cuda) | fp32 | bf16 | fp16
    #: set the model's dropout rates to 0 when it is loaded (TRL's default): the policy's forwards then match
    #: the reference's, and DPO starts at ln 2; false = keep the checkpoint's dropout in training forwards
    disable_dropout: bool = True


@dataclass
class OfflineModelConfig(LoRAConfig, _StartingModel):
    """The starting model, optionally trained through LoRA adapters (verl SFT's ``model.lora_rank`` ...); DPO
    and KTO then take their reference log-probs from the same module with the adapter off."""


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


C = TypeVar("C", bound="_OfflineConfig")


@dataclass
class _OfflineConfig:
    """What the three configs share: loading, resolving, validating."""

    model: OfflineModelConfig = field(default_factory=OfflineModelConfig)  #: the model trained
    optim: OfflineOptimConfig = field(default_factory=OfflineOptimConfig)  #: its optimizer
    #: the run: length, logging, workers, checkpoints (PPO's trainer section)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    kind = ""  # sft | dpo | kto: the objective, the YAML file and the command's name

    @classmethod
    def from_dict(cls: type[C], tree: dict[str, Any]) -> C:
        """A (partial) nested dict merged over the defaults, then typed (not resolved or validated)."""
        merged = cls().to_dict()
        base.merge(merged, tree, [], "from_dict", cls)
        return base.build_config(merged, cls)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def resolve(self: C) -> C:
        """A copy with derived values filled: device and dtype ``auto``, ``data.seed`` null -> trainer.seed,
        ``${...}`` interpolations, ``~`` in paths."""
        cfg = type(self).from_dict(self.to_dict())
        if cfg.trainer.device == "auto":
            cfg.trainer.device = "cuda" if cuda_available() else "cpu"
        cfg.model.dtype = DTYPE_ALIASES.get(cfg.model.dtype, cfg.model.dtype)
        if cfg.model.dtype == "auto":
            cfg.model.dtype = "bf16" if cfg.trainer.device == "cuda" else "fp32"
        if cfg.data.seed is None:
            cfg.data.seed = cfg.trainer.seed
        expand = os.path.expanduser
        cfg.model.partial_pretrain = expand(cfg.model.partial_pretrain)
        cfg.trainer.default_local_dir = expand(cfg.trainer.default_local_dir)
        for key in ("train_files", "val_files"):
            files = getattr(cfg.data, key)
            setattr(cfg.data, key, [expand(f) for f in files] if files else files)
        return cfg

    def validate(self) -> None:
        """ConfigError naming the first inconsistent key."""
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


CONFIGS: dict[str, type[_OfflineConfig]] = {"sft": SFTConfig, "dpo": DPOConfig, "kto": KTOConfig}


def default_config_path(cls: type[_OfflineConfig]) -> Path:
    """The packaged YAML of a trainer: ``config/{sft,dpo,kto}_trainer.yaml``."""
    return CONFIG_DIR / f"{cls.kind}_trainer.yaml"


def load_offline_config(
    cls: type[C], overrides: list[str] | None = None, config_path: str | os.PathLike | None = None
) -> C:
    """The packaged YAML of ``cls``, a user YAML merged over it, then dotted overrides; resolved, validated.
    Same syntax as ``load_config`` for PPO."""
    tree = base.load_yaml(default_config_path(cls))
    if config_path is not None:
        base.merge(tree, base.load_yaml(config_path), [], f"config file {os.fspath(config_path)}", cls)
    for text in overrides or []:
        base.apply_override(tree, text, cls)
    cfg = base.build_config(tree, cls).resolve()
    cfg.validate()
    return cfg
