"""Checks of the trainer config: value ranges, batch-size arithmetic, names, cross-field rules, and the
table of verl keys that have no effect here (the keys that have no effect without another one: ``key_pairs``).

They read a resolved ``PPOConfig`` by attribute only (``cfg.actor_rollout_ref.actor.optim.lr``), so this
module comes before the schema (``schema.py``) and imports none of it; ``PPOConfig.validate`` runs them.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, TypeVar

from hybridflow.dataflow.replay_buffer import ScheduledSampler
from hybridflow.utils.errors import UserError

T = TypeVar("T")


class ConfigError(UserError, ValueError):
    """A configuration that cannot be used; the message names the key (full dotted path)."""


class IgnoredKeyWarning(UserWarning):
    """A verl key with no effect on this backend was set: dropped, or (a schema key) kept but unused."""


class DeprecatedKeyWarning(FutureWarning):
    """A key that moved was set by its old name, which works for one release (the message names the new one).
    A ``FutureWarning``, Python's deprecation warning for end users: shown by default, unlike a
    ``DeprecationWarning``, which would hide it from a command line."""


# ------------------------------------------------------------------------------- verl keys ignored here


class IgnoredKey(NamedTuple):
    """A verl key with no effect on this backend: an fnmatch glob over the dotted key (and all below it)."""

    pattern: str
    why: str
    used_with_vllm: bool = False  # the key does take effect when actor_rollout_ref.rollout.name is vllm


_VLLM_TUNING = "vLLM engine tuning that hybridflow does not expose"
_PLACEMENT = "GPU placement; hybridflow runs trainer.n_workers workers on trainer.device"

# rollout keys only the vLLM engine reads (they warn with rollout.name=hf); the first four mean nothing on
# vLLM's CPU build either. rollout.dtype, seed and max_model_len are derived, so they never warn.
VLLM_GPU_ONLY_KEYS = (
    "gpu_memory_utilization",
    "tensor_model_parallel_size",
    "free_cache_engine",
    "enforce_eager",
)
VLLM_ENGINE_KEYS = (
    *VLLM_GPU_ONLY_KEYS,
    "max_num_batched_tokens",
    "max_num_seqs",
    "enable_chunked_prefill",
    "partial_rollout_chunk",
)

IGNORED_KEYS: tuple[IgnoredKey, ...] = (
    *(
        IgnoredKey(
            f"*.fsdp_config.{name}",
            "FSDP tuning not exposed here; fsdp_config has param_offload, "
            "optimizer_offload, reshard_after_forward, fsdp_size",
        )
        for name in (
            "wrap_policy",
            "offload_policy",
            "forward_prefetch",
            "model_dtype",
            "mixed_precision",
            "entropy_checkpointing",
        )
    ),
    IgnoredKey("reward_model.model.fsdp_config", "the reward model is not sharded"),
    IgnoredKey("*.megatron", "the Megatron-LM backend is not supported"),
    IgnoredKey(
        "critic.forward_max_token_len_per_gpu",
        "the critic's value pass uses critic.ppo_max_token_len_per_gpu",
    ),
    IgnoredKey(
        "reward_model.model.use_remove_padding", "the reward model scores each sequence as one padded row"
    ),
    IgnoredKey("*.use_torch_compile", "GPU kernel option"),
    IgnoredKey("*.use_liger", "GPU kernel option"),
    IgnoredKey("*.use_fused_kernels", "GPU kernel option"),
    IgnoredKey("reward_model.strategy", "the reward model follows actor_rollout_ref.actor.strategy"),
    *(
        IgnoredKey(f"actor_rollout_ref.rollout.{name}", "a vLLM engine key (rollout.name=vllm)", True)
        for name in VLLM_ENGINE_KEYS
    ),
    *(
        IgnoredKey(f"actor_rollout_ref.rollout.{name}", _VLLM_TUNING)
        for name in ("load_format", "disable_log_stats", "engine_kwargs", "mode")
    ),
    IgnoredKey("trainer.n_gpus_per_node", _PLACEMENT),
    IgnoredKey("trainer.nnodes", _PLACEMENT),
    IgnoredKey("trainer.default_hdfs_dir", "HDFS checkpoint copies are not supported"),
    IgnoredKey("trainer.del_local_ckpt_after_load", "HDFS checkpoint copies are not supported"),
    IgnoredKey("trainer.ray_wait_register_center_timeout", "verl's Ray register-center tuning"),
    IgnoredKey(
        "actor_rollout_ref.actor.checkpoint.save_contents",
        "checkpoints always hold the model, optimizer and extra state",
    ),
    IgnoredKey("reward_model.reward_manager", "one reward manager (naive: one call per sample)"),
    IgnoredKey(
        "reward_model.launch_reward_fn_async", "rewards are computed in the step, not in the background"
    ),
    IgnoredKey("trainer.balance_batch", "batches are not reordered by token count"),
    IgnoredKey("reward_model.overlong_buffer.log", "the penalty is always logged (reward/overlong_*)"),
    # schema keys whose alternatives hybridflow does not have (yet): they warn when set away from the default
    IgnoredKey("actor_rollout_ref.hybrid_engine", "the rollout always shares the actor's module here"),
)


def ignored_rule(key: str) -> IgnoredKey | None:
    parts = key.split(".")
    prefixes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
    return next((r for p in prefixes for r in IGNORED_KEYS if fnmatch.fnmatchcase(p, r.pattern)), None)


def warn_ignored(key: str, rule: IgnoredKey, value: Any) -> None:
    warnings.warn(f"ignored on this backend: {key} = {value!r} ({rule.why})", IgnoredKeyWarning, stacklevel=2)


# ----------------------------------------------------------------------------------------- validation

DTYPE_ALIASES: dict[str, Literal["fp32", "bf16", "fp16"]] = {
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
}


def cuda_available() -> bool:
    import torch  # lazily: only resolve() needs it

    return torch.cuda.is_available()


def required(value: T | None, key: str) -> T:
    """The value of ``key``, a setting that resolving or validating the config fills in or requires (a
    seed taken from ``trainer.seed``, the model path): typed without None; a ConfigError naming the key when
    it is None, i.e. the config was used before ``validate()``."""
    if value is None:
        raise ConfigError(f"{key} is not set (was the config validated? PPOConfig.validate() fills it in)")
    return value


def get_key(obj: Any, key: str) -> Any:
    for name in key.split("."):
        obj = getattr(obj, name)
    return obj


def path_fields(cfg: Any) -> list[tuple[Any, str]]:
    """(object, attribute) of every field holding a file path, where ``~`` is expanded."""
    return [
        (cfg.data, "train_files"),
        (cfg.data, "val_files"),
        (cfg.data.sft, "files"),
        (cfg.actor_rollout_ref.model, "path"),
        (cfg.critic.model, "path"),
        (cfg.reward_model.model, "path"),
        (cfg.custom_reward_function, "path"),
        (cfg.trainer, "default_local_dir"),
        (cfg.trainer, "resume_from_path"),
        (cfg.actor_rollout_ref.rollout.multi_turn, "tool_config_path"),
        (cfg.actor_rollout_ref.rollout.served_agent, "path"),
        (cfg.actor_rollout_ref.teacher, "path"),
    ]


#: a value check: (predicate, what the value must be)
Range = tuple[Callable[[Any], bool], str]
_POSITIVE: Range = (lambda v: v >= 1, ">= 1")
_NON_NEGATIVE = (lambda v: v >= 0, ">= 0")
_GREATER_THAN_0 = (lambda v: v > 0, "> 0")
_UNIT = (lambda v: 0 <= v <= 1, "in [0, 1]")
_UNIT_NOT_0 = (lambda v: 0 < v <= 1, "in (0, 1]")
_FREQUENCY = (lambda v: v == -1 or v >= 1, "-1 (never) or >= 1")
_TOP_K = (lambda v: v >= -1, "-1 (off) or >= 0")


def _sampling_ranges(prefix: str) -> dict[str, Range]:
    return {
        f"{prefix}.n": _POSITIVE,
        f"{prefix}.temperature": _NON_NEGATIVE,
        f"{prefix}.top_p": _UNIT_NOT_0,
        f"{prefix}.top_k": _TOP_K,
    }


def _optim_ranges(prefix: str) -> dict[str, Range]:
    return {
        f"{prefix}.lr": _NON_NEGATIVE,
        f"{prefix}.weight_decay": _NON_NEGATIVE,
        f"{prefix}.lr_warmup_steps": (lambda v: v >= -1, "-1 (use lr_warmup_steps_ratio) or >= 0"),
        f"{prefix}.lr_warmup_steps_ratio": _UNIT,
        f"{prefix}.min_lr_ratio": _UNIT,
    }


_ACTOR, _ROLLOUT = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
_SEQUENCE_PARALLEL_KEYS = tuple(
    f"{r}.ulysses_sequence_parallel_size" for r in (_ACTOR, "actor_rollout_ref.ref", "critic")
)
# key -> (predicate, what it must be); a null (optional) value is not checked.
_RANGES: dict[str, Range] = {
    **{
        f"data.{k}": _POSITIVE
        for k in (
            "train_batch_size",
            "val_batch_size",
            "max_prompt_length",
            "max_response_length",
            "sft.every_n_steps",
            "sft.batch_size",
        )
    },
    "data.sft.loss_coef": _NON_NEGATIVE,
    **{
        f"{r}.{k}": _POSITIVE
        for r in (_ACTOR, "critic")
        for k in ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_epochs")
    },
    **{f"{r}.grad_clip": _GREATER_THAN_0 for r in (_ACTOR, "critic")},
    f"{_ACTOR}.clip_ratio": _GREATER_THAN_0,
    f"{_ACTOR}.clip_ratio_low": _GREATER_THAN_0,
    f"{_ACTOR}.clip_ratio_high": _GREATER_THAN_0,
    f"{_ACTOR}.clip_ratio_c": (lambda v: v > 1, "> 1"),
    f"{_ACTOR}.kl_loss_coef": _NON_NEGATIVE,
    "critic.cliprange_value": _GREATER_THAN_0,
    **_optim_ranges(f"{_ACTOR}.optim"),
    **_optim_ranges("critic.optim"),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": _POSITIVE,
    **{
        k: _POSITIVE
        for k in (
            f"{_ACTOR}.ppo_max_token_len_per_gpu",
            "critic.ppo_max_token_len_per_gpu",
            f"{_ROLLOUT}.log_prob_max_token_len_per_gpu",
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
        )
    },
    **{key: _POSITIVE for key in _SEQUENCE_PARALLEL_KEYS},
    "actor_rollout_ref.model.lora_rank": _NON_NEGATIVE,
    **{f"reward_model.code.{k}": _POSITIVE for k in ("max_concurrent", "memory_limit_mb")},
    **{f"reward_model.code.{k}": _GREATER_THAN_0 for k in ("sample_timeout_s", "test_timeout_s")},
    **{
        f"reward_model.judge.{k}": _POSITIVE
        for k in ("max_tokens", "micro_batch_size_per_gpu", "max_concurrent")
    },
    "reward_model.judge.request_timeout_s": _GREATER_THAN_0,
    "actor_rollout_ref.model.lora_alpha": _GREATER_THAN_0,
    **{
        f"{r}.fsdp_config.fsdp_size": (lambda v: v == -1 or v >= 1, "-1 (all ranks) or >= 1")
        for r in (_ACTOR, "actor_rollout_ref.ref", "critic.model")
    },
    **_sampling_ranges(_ROLLOUT),
    **_sampling_ranges(f"{_ROLLOUT}.val_kwargs"),
    f"{_ROLLOUT}.served_agent.batch_window_ms": _NON_NEGATIVE,
    **{
        f"{_ROLLOUT}.{k}": _POSITIVE
        for k in (
            "log_prob_micro_batch_size_per_gpu",
            "micro_batch_size",
            "tensor_model_parallel_size",
            "partial_rollout_chunk",
            "weight_sync_bucket_mb",
        )
    },
    f"{_ROLLOUT}.gpu_memory_utilization": _UNIT_NOT_0,
    "reward_model.micro_batch_size_per_gpu": _POSITIVE,
    "reward_model.two_stage.top_k_ratio": _UNIT_NOT_0,
    "reward_model.two_stage.unselected_scale": _NON_NEGATIVE,
    "algorithm.gamma": _UNIT,
    "algorithm.lam": _UNIT,
    "algorithm.kl_ctrl.kl_coef": _NON_NEGATIVE,
    "algorithm.kl_ctrl.horizon": _POSITIVE,
    "algorithm.kl_ctrl.target_kl": _GREATER_THAN_0,
    "replay_buffer.capacity": _POSITIVE,
    "replay_buffer.sample_size": _NON_NEGATIVE,
    "replay_buffer.alpha": _NON_NEGATIVE,
    "replay_buffer.beta": _UNIT,
    **{
        f"trainer.{k}": _POSITIVE
        for k in ("total_epochs", "total_training_steps", "n_workers", "max_ckpt_to_keep", "nnodes")
    },
    **{f"trainer.{k}": _NON_NEGATIVE for k in ("log_val_generations", "n_gpus_per_node", "critic_warmup")},
    "trainer.cpus_per_worker": _GREATER_THAN_0,
    "async_training.max_staleness": _NON_NEGATIVE,
    "data.gen_batch_size": _POSITIVE,
    "algorithm.filter_groups.max_num_gen_batches": _NON_NEGATIVE,
    "reward_model.overlong_buffer.penalty_factor": _NON_NEGATIVE,
    **{f"{_ACTOR}.policy_loss.{k}": _GREATER_THAN_0 for k in ("clip_cov_ratio", "kl_cov_ratio")},
    f"{_ACTOR}.policy_loss.ppo_kl_coef": _NON_NEGATIVE,
    "actor_rollout_ref.teacher.kl_coef": _NON_NEGATIVE,
    "actor_rollout_ref.teacher.task_reward_coef": _NON_NEGATIVE,
    "trainer.save_freq": _FREQUENCY,
    "trainer.test_freq": _FREQUENCY,
}


def check_ranges(cfg: Any) -> None:
    for key, (ok, expected) in _RANGES.items():
        value = get_key(cfg, key)
        if value is not None and not ok(value):
            raise ConfigError(f"{key} must be {expected}, got {value}")
    for key in (f"{_ACTOR}.optim.betas", "critic.optim.betas"):
        betas = get_key(cfg, key)
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ConfigError(f"{key} must be two numbers in [0, 1) (Adam's beta1, beta2), got {betas}")
    bounds = cfg.actor_rollout_ref.actor.off_policy_mask_bounds
    if len(bounds) != 2 or not 0 <= bounds[0] <= 1 <= bounds[1]:
        raise ConfigError(
            f"{_ACTOR}.off_policy_mask_bounds must be [low, high] with 0 <= low <= 1 <= high, got {bounds}"
        )


def check_batch_sizes(cfg: Any) -> None:
    """The batch arithmetic: prompts -> sequences (x rollout.n) -> workers -> mini- and micro-batches."""
    prompts, n, workers = cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n, cfg.trainer.n_workers
    if cfg.trainer.backend == "local" and workers != 1:
        raise ConfigError(
            f"trainer.n_workers={workers} needs trainer.backend=ray: the local backend runs one "
            "worker in this process; set trainer.backend=ray for data-parallel workers"
        )
    if prompts * n % workers:
        raise ConfigError(
            f"data.train_batch_size * {_ROLLOUT}.n = {prompts} * {n} = {prompts * n} sequences do not divide "
            f"evenly across trainer.n_workers ({workers})"
        )
    roles = [(_ACTOR, cfg.actor_rollout_ref.actor)] + ([("critic", cfg.critic)] if cfg.critic.enable else [])
    for name, role in roles:
        mini, micro = role.ppo_mini_batch_size, role.ppo_micro_batch_size_per_gpu
        if mini > prompts:
            raise ConfigError(
                f"{name}.ppo_mini_batch_size ({mini}) is larger than data.train_batch_size ({prompts}): "
                "a mini-batch is a slice of one step's prompts"
            )
        if prompts % mini:
            raise ConfigError(
                f"data.train_batch_size ({prompts}) is not a multiple of {name}.ppo_mini_batch_size ({mini}): "
                f"{prompts} = {prompts // mini} * {mini} + {prompts % mini} would leave a partial mini-batch"
            )
        if not role.use_dynamic_bsz and mini * n % (micro * workers):
            raise ConfigError(
                f"{name}.ppo_mini_batch_size * {_ROLLOUT}.n = {mini} * {n} = {mini * n} sequences per "
                f"mini-batch is not divisible by {name}.ppo_micro_batch_size_per_gpu * trainer.n_workers = "
                f"{micro} * {workers} = {micro * workers}: each worker's share of a mini-batch must split "
                "into whole micro-batches"
            )


def check_choices(cfg: Any) -> None:
    """Names looked up in the algorithm registries (which users extend, so no fixed list here)."""
    from hybridflow.algorithms import get_adv_estimator_fn, get_policy_loss_fn

    for key, lookup in (
        ("algorithm.adv_estimator", get_adv_estimator_fn),
        (f"{_ACTOR}.policy_loss.loss_mode", get_policy_loss_fn),
    ):
        try:
            lookup(get_key(cfg, key))
        except ValueError as err:
            raise ConfigError(f"{key}: {err}") from None


def check_cross_fields(cfg: Any) -> None:
    data, rm, trainer = cfg.data, cfg.reward_model, cfg.trainer
    problems = [
        (
            not trainer.val_only and not data.train_files,
            "data.train_files is required: one or more prompt files, e.g. data.train_files=[a.parquet,b.parquet]",
        ),
        (trainer.val_only and not data.val_files, "trainer.val_only=true needs data.val_files"),
        (not cfg.actor_rollout_ref.model.path, "actor_rollout_ref.model.path is required"),
        (
            cfg.actor_rollout_ref.rollout.served_agent.path is not None
            and cfg.actor_rollout_ref.rollout.multi_turn.enable,
            f"{_ROLLOUT}.served_agent.path and {_ROLLOUT}.multi_turn.enable are two rollout modes: the served "
            "agent runs its own tool loop; turn one of them off",
        ),
        (
            cfg.actor_rollout_ref.rollout.served_agent.path is not None
            and (rm.enable or cfg.custom_reward_function.path is not None),
            f"{_ROLLOUT}.served_agent.path: the agent's return value is the reward, so "
            f"{'reward_model.enable' if rm.enable else 'custom_reward_function.path'} would never be used; "
            "unset it, or score inside the agent",
        ),
        (
            cfg.algorithm.adv_estimator == "gae" and not cfg.critic.enable,
            "algorithm.adv_estimator 'gae' needs a value model, but critic.enable is false",
        ),
        *_reward_problems(cfg),
        (
            trainer.resume_mode == "resume_path" and not trainer.resume_from_path,
            "trainer.resume_mode 'resume_path' needs trainer.resume_from_path",
        ),
        (
            trainer.resume_mode != "resume_path" and trainer.resume_from_path is not None,
            f"trainer.resume_from_path is set but trainer.resume_mode is {trainer.resume_mode!r}; "
            "set trainer.resume_mode=resume_path to resume from it",
        ),
        *_placement_problems(cfg),
        *_async_problems(cfg),
        *_sample_efficiency_problems(cfg),
    ]
    for failed, message in problems:
        if failed:
            raise ConfigError(message)
    steps = [entry.until_step for entry in cfg.replay_buffer.schedule or []]
    if steps != sorted(set(steps)):
        raise ConfigError(f"replay_buffer.schedule until_step values must strictly increase, got {steps}")
    if cfg.replay_buffer.enable:  # the sampler checks its own settings: its refusal is a config mistake
        try:
            ScheduledSampler.from_config(cfg.replay_buffer)
        except ValueError as err:
            raise ConfigError(f"replay_buffer: {err}") from err


def _reward_problems(cfg: Any) -> list[tuple[bool, str]]:
    """A reward model or judge needs what it reads, a judge's settings must parse, and the rule score combines
    with a model's one way at a time."""
    rm = cfg.reward_model
    return [
        (
            rm.enable
            and not rm.dummy
            and not rm.model.path
            and not (rm.style == "generative" and rm.judge.base_url),
            "reward_model.enable=true needs reward_model.model.path (or reward_model.dummy=true; a generative "
            "judge: reward_model.judge.base_url)",
        ),
        (
            rm.judge.base_url is not None and rm.style != "generative",
            "reward_model.judge.base_url is set but reward_model.style is 'discriminative': the judge only "
            "scores with reward_model.style=generative",
        ),
        (
            rm.style == "generative" and "{response}" not in rm.judge.prompt_template,
            "reward_model.judge.prompt_template must contain {response} (and may use {prompt}, {ground_truth})",
        ),
        (
            len(rm.judge.score_range) != 2 or rm.judge.score_range[0] >= rm.judge.score_range[1],
            f"reward_model.judge.score_range must be [low, high] with low < high, got {rm.judge.score_range}",
        ),
        (
            not rm.judge.yes_words or not rm.judge.no_words,
            "reward_model.judge.yes_words and no_words each need at least one word",
        ),
        (
            rm.rule_weight != 0 and not rm.enable,
            "reward_model.rule_weight adds the rule score to a reward model's: it needs reward_model.enable=true",
        ),
        (
            rm.rule_weight != 0 and rm.two_stage.enable,
            "reward_model.rule_weight (a weighted sum) and reward_model.two_stage (the rule ranks, the model "
            "re-scores the best) are two ways to combine them: choose one",
        ),
        (
            rm.two_stage.enable and not rm.enable,
            "reward_model.two_stage.enable=true needs reward_model.enable=true",
        ),
    ]


def _placement_problems(cfg: Any) -> list[tuple[bool, str]]:
    """Where the roles run: Ray placement needs the Ray backend, cuda a GPU, and every strategy's group sizes
    must divide the workers."""
    trainer = cfg.trainer
    return [
        (
            trainer.backend == "local"
            and (
                trainer.placement != "colocated"
                or trainer.resource_pool_spec
                or trainer.role_pools
                or trainer.pool_resources
            ),
            "trainer.placement, resource_pool_spec, role_pools and pool_resources place roles in Ray worker "
            "processes: "
            "set trainer.backend=ray (or keep trainer.placement=colocated)",
        ),
        (
            trainer.device == "cuda" and not cuda_available(),
            "trainer.device is 'cuda' but torch.cuda.is_available() is false",
        ),
        *(
            (
                get_key(cfg, key) == "single" and trainer.n_workers > 1,
                f"{key}=single runs on one worker, but trainer.n_workers is {trainer.n_workers}: use ddp or fsdp2",
            )
            for key in (f"{_ACTOR}.strategy", "actor_rollout_ref.ref.strategy", "critic.strategy")
        ),
        *(
            (
                get_key(cfg, key) > 0 and trainer.n_workers % get_key(cfg, key) != 0,
                f"{key}={get_key(cfg, key)} does not divide trainer.n_workers ({trainer.n_workers}): each model is "
                "sharded over groups of that many workers; use -1 (all workers) or a divisor",
            )
            for key in (
                f"{r}.fsdp_config.fsdp_size" for r in (_ACTOR, "actor_rollout_ref.ref", "critic.model")
            )
        ),
        *(
            (
                trainer.n_workers % get_key(cfg, key) != 0,
                f"{key}={get_key(cfg, key)} does not divide trainer.n_workers ({trainer.n_workers}): each "
                "sequence is split over a group of that many workers",
            )
            for key in _SEQUENCE_PARALLEL_KEYS
        ),
    ]


def _async_problems(cfg: Any) -> list[tuple[bool, str]]:
    """An asynchronous rollout needs a rollout worker of its own (the trainer changes the actor's module while
    it generates), and a partial rollout an engine that can swap weights between decoding steps."""
    run, rollout, trainer = cfg.async_training, cfg.actor_rollout_ref.rollout, cfg.trainer
    partial = run.mode == "fully_async" and run.partial_rollout
    return [
        (
            run.mode != "sync" and trainer.backend == "ray" and trainer.placement != "split",
            f"async_training.mode={run.mode} generates while the actor trains, in a rollout worker of its own: "
            "set trainer.placement=split on the Ray backend",
        ),
        (
            partial and (rollout.multi_turn.enable or rollout.served_agent.path is not None),
            "async_training.partial_rollout=true swaps weights between decoding steps, which the hf and vllm "
            "rollouts do but not the agent loop or a served agent: set async_training.partial_rollout=false",
        ),
    ]


def _sample_efficiency_problems(cfg: Any) -> list[tuple[bool, str]]:
    """Dynamic sampling, overlong shaping and on-policy distillation: the keys that need another key, and the
    settings that would do nothing."""
    data, alg, arr = cfg.data, cfg.algorithm, cfg.actor_rollout_ref
    groups, buffer = alg.filter_groups, cfg.reward_model.overlong_buffer
    single = arr.rollout.n == 1 and arr.rollout.served_agent.path is None
    return [
        (
            groups.enable and single,
            "algorithm.filter_groups.enable=true drops groups whose samples all score the same, but with "
            f"{_ROLLOUT}.n=1 every group is one sample and is kept: set {_ROLLOUT}.n > 1",
        ),
        (
            data.gen_batch_size is not None
            and data.gen_batch_size != data.train_batch_size
            and not groups.enable,
            f"data.gen_batch_size={data.gen_batch_size} sets the prompts per generation batch of dynamic "
            "sampling: it needs algorithm.filter_groups.enable=true (or leave it null)",
        ),
        (
            groups.enable and groups.metric == "seq_final_reward" and alg.use_kl_in_reward,
            "algorithm.filter_groups.metric=seq_final_reward: groups are filtered before the in-reward KL "
            "penalty (algorithm.use_kl_in_reward) exists; use seq_reward",
        ),
        (
            buffer.enable and not 0 < buffer.len <= data.max_response_length,
            f"reward_model.overlong_buffer.len must be in (0, data.max_response_length={data.max_response_length}] "
            f"when reward_model.overlong_buffer.enable=true, got {buffer.len}",
        ),
        (
            arr.teacher.path is not None and arr.teacher.kl_coef == 0,
            "actor_rollout_ref.teacher.kl_coef=0 gives the teacher's signal no weight: raise it, or unset "
            "actor_rollout_ref.teacher.path",
        ),
    ]
