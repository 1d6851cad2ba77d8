"""The sections every trainer's config shares: the run (``trainer``), the optimiser, model loading, LoRA,
FSDP2 sharding and the data files, defined once for PPO and the offline trainers (SFT, DPO, KTO), and how
every root config derives its ``auto`` values the same way (``resolve_shared``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hybridflow.config import checks
from hybridflow.config.checks import DTYPE_ALIASES

YAML_DIR = Path(__file__).parent / "yaml"  # the shipped YAML files, generated from the schemas

Dtype = Literal["auto", "fp32", "bf16", "fp16", "float32", "bfloat16", "float16"]


@dataclass
class DataFilesConfig:
    """Training and held-out files, the batch size and order: what every trainer's data section has."""

    #: required: training file(s), parquet or JSONL, one path or a list [a.parquet, b.parquet]
    train_files: list[str] | None = None
    val_files: list[str] | None = None  #: held-out file(s) for validation; null = no validation
    prompt_key: str = "prompt"  #: column holding the prompt (a chat message list or a plain string)
    #: column holding each row's images (a list of {"bytes": ...} / {"path": ...}, bytes or paths), one per
    #: <image> placeholder in the prompt; read with a vision-language model only
    image_key: str = "images"
    #: render prompts (and offline completions) with the tokenizer's chat template (a string prompt is one user
    #: turn); false = strings fed as they are (pre-rendered text, base models without a template): prompt ids
    #: are the tokenizer's plain output (RL chat messages: their contents joined by newlines; offline
    #: completions get EOS appended)
    apply_chat_template: bool = True
    #: rows per training step (PPO: prompts, each gets rollout.n responses; DPO: pairs; KTO: completions)
    train_batch_size: int = 8
    #: a sample over the length limit: error | left (cut the prompt's start) | right (cut the end)
    truncation: Literal["error", "left", "right"] = "error"
    shuffle: bool = True  #: shuffle the training rows each epoch
    seed: int | None = None  #: data order seed; null = trainer.seed


@dataclass
class ModelLoadingConfig:
    """How a Hugging Face model is loaded, whichever key names its folder."""

    trust_remote_code: bool = False  #: allow model code shipped with the checkpoint
    #: recompute activations in backward: less memory, about 30% slower
    enable_gradient_checkpointing: bool = False
    #: auto (fp32 on cpu, bf16 on cuda) | fp32 | bf16 | fp16 (or float32 | bfloat16 | float16)
    dtype: Dtype = "auto"
    #: set the model's dropout rates to 0 when it is loaded for training (TRL's default): updates then see the
    #: policy the log-probs were computed with, and DPO starts at ln 2; false = keep the checkpoint's dropout
    disable_dropout: bool = True


@dataclass
class LoRAConfig:
    """Training through LoRA adapters (``peft``) on frozen base weights; the reference policy is then the same
    module with the adapter switched off, so no second copy of the weights is loaded."""

    #: LoRA rank; 0 trains every weight, > 0 trains rank-r adapters (the reference is the base)
    lora_rank: int = 0
    #: LoRA scale numerator: the adapter's update is multiplied by lora_alpha / lora_rank
    lora_alpha: int = 16
    #: which linear layers get adapters: ["all-linear"] (all but the output layer) or module names,
    #: e.g. [q_proj, v_proj]
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])


@dataclass
class VisionTrainingConfig:
    """What a vision-language model trains (a text model has no vision tower: the key then does nothing)."""

    #: keep the vision tower's weights fixed: the language model and the projector (Qwen's merger, LLaVA's
    #: multi_modal_projector) train
    freeze_vision_tower: bool = False


@dataclass
class FSDPConfig:
    """FSDP2 sharding of one model (used when its strategy is fsdp2)."""

    param_offload: bool = False  #: keep parameter shards in CPU memory between uses (CUDA only; no-op on CPU)
    optimizer_offload: bool = False  #: keep AdamW moments in CPU memory outside the step (CUDA only)
    #: free gathered layers after the forward (less memory, one more gather)
    reshard_after_forward: bool = True
    fsdp_size: int = -1  #: ranks one model is sharded over; -1 = all; smaller replicates across groups (HSDP)


@dataclass
class OptimConfig:
    """AdamW with an optional warmup and cosine decay; shared by actor and critic."""

    lr: float = 1e-6  #: learning rate
    weight_decay: float = 0.01  #: AdamW weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  #: AdamW betas
    lr_warmup_steps: int = -1  #: warmup steps; -1 = use lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = 0.0  #: warmup as a share of total_training_steps
    warmup_style: Literal["constant", "cosine"] = "constant"  #: after warmup: constant | cosine
    min_lr_ratio: float = 0.0  #: cosine decays to lr * min_lr_ratio
    total_training_steps: int = -1  #: filled in by the trainer


@dataclass
class TrainerConfig:
    """The run: length, logging, workers, validation and checkpoint cadence, resuming."""

    total_epochs: int = 1  #: passes over the training prompts
    total_training_steps: int | None = None  #: stop after this many steps; null = total_epochs worth
    project_name: str = "hybridflow"  #: groups runs in the loggers and the run folder
    experiment_name: str = "run"  #: this run's name
    #: any of console | file | tensorboard | wandb | mlflow (a bare name works)
    logger: list[Literal["console", "file", "tensorboard", "wandb", "mlflow"]] = field(
        default_factory=lambda: ["console", "file"]
    )
    log_val_generations: int = 0  #: validation samples to print/log each validation
    nnodes: int = 1  #: verl key; ignored here (use n_workers)
    n_gpus_per_node: int = 0  #: verl key; ignored here (use n_workers)
    #: where the workers run: auto (cuda if available) | cpu | cuda
    device: Literal["auto", "cpu", "cuda"] = "auto"
    backend: Literal["local", "ray"] = "local"  #: worker groups in this process (local) or on Ray (ray)
    n_workers: int = 1  #: data-parallel workers (backend=ray; the local backend runs exactly one)
    #: keyword arguments for ray.init, e.g. +trainer.ray_kwargs.num_cpus=4
    ray_kwargs: dict[str, Any] = field(default_factory=dict)
    #: where the roles run on the Ray backend: colocated = every role in one process per rank (the hybrid
    #: engine); split = the actor (with reference and critic), the rollout, and the reward (function and
    #: model) each in their own processes, weights sent to the rollout after every update
    placement: Literal["colocated", "split"] = "colocated"
    #: Ray resource pools, pool name -> processes per node (e.g. {actor: [2], rollout: [1]}); overrides the
    #: placement preset's pools of the same name
    resource_pool_spec: dict[str, Any] = field(default_factory=dict)
    #: role (actor, rollout, ref, critic, reward_model, reward) -> pool name; overrides the preset's mapping
    role_pools: dict[str, Any] = field(default_factory=dict)
    #: pool name -> Ray custom resources each of its processes asks for, pinning the pool to the nodes that
    #: declare them (`ray start --resources='{"node_b": 1}'`), e.g. +trainer.pool_resources.rollout={node_b:0.01}
    pool_resources: dict[str, Any] = field(default_factory=dict)
    #: CPUs each Ray worker process reserves (fractions let roles share cores); when Ray has fewer than the
    #: processes ask for together, they share its CPUs equally
    cpus_per_worker: float = 1.0
    #: worker processes hand freed blocks of 4 MiB and more back to the OS at once (glibc; no effect on other
    #: C libraries), so a rank's peak memory shrinks with its shards instead of keeping what it freed
    return_freed_memory: bool = True
    #: Ray worker processes on one machine share its cores as their work comes and goes: a process at work
    #: takes the cores divided among those at work at that moment (a trainer takes a waiting rollout's); off,
    #: each keeps a fixed equal share. The local backend runs in one process and shares nothing
    share_cores: bool = True
    save_freq: int = -1  #: save a checkpoint every N steps; -1 = never
    test_freq: int = -1  #: validate every N steps; -1 = never
    val_before_train: bool = True  #: validate once before the first step
    val_only: bool = False  #: validate and stop
    #: run folder (checkpoints, logs)
    default_local_dir: str = "runs/${trainer.project_name}/${trainer.experiment_name}"
    #: auto (latest checkpoint in the run folder) | disable | resume_path
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    resume_from_path: str | None = None  #: checkpoint folder for resume_mode resume_path
    max_ckpt_to_keep: int | None = None  #: keep only the newest N checkpoints; null = all
    seed: int = 42  #: global seed
    critic_warmup: int = 0  #: first N steps update only the critic (the actor waits for useful values)


def resolve_shared(cfg: Any, models: list[ModelLoadingConfig], paths: list[tuple[Any, str]]) -> None:
    """Fill what every root config derives alike, in place: ``trainer.device`` auto -> cuda if available else
    cpu; each model's ``dtype`` auto -> bf16 on cuda, fp32 on cpu (aliases like bfloat16 -> bf16);
    ``data.seed`` null -> ``trainer.seed``; ``~`` expanded in the path fields ``(owner, attribute)``."""
    trainer = cfg.trainer
    if trainer.device == "auto":
        trainer.device = "cuda" if checks.cuda_available() else "cpu"
    for model in models:
        model.dtype = DTYPE_ALIASES.get(model.dtype, model.dtype)
        if model.dtype == "auto":
            model.dtype = "bf16" if trainer.device == "cuda" else "fp32"
    if cfg.data.seed is None:
        cfg.data.seed = trainer.seed
    for owner, name in paths:
        value = getattr(owner, name)
        if isinstance(value, str):
            setattr(owner, name, os.path.expanduser(value))
        elif isinstance(value, list):
            setattr(owner, name, [os.path.expanduser(v) for v in value])
