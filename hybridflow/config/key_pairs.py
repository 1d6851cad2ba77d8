"""Keys that have no effect without another one: one table (``KEY_PAIRS``), in the style of ``checks.py``'s.

A user who sets ``reward_model.dummy=true`` and not ``reward_model.enable=true`` gets the rule scorers, and
``async_training.max_staleness=4`` in a sync run changes nothing: a key that silently does nothing costs a
run. Each pair names keys (globs over the dotted keys), when they are idle (a condition on the resolved
config), and what they need; a key set away from its default while idle warns (``UnusedKeyWarning``) or, where
the run would compute something else than the key asks for, is refused (``ConfigError``). ``validate`` runs
the check on every trainer's config; ``hybridflow doctor`` lists what it finds on its config line.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from hybridflow.config.checks import ConfigError, get_key


class UnusedKeyWarning(UserWarning):
    """A key was set that has no effect without another one; the message names what it needs."""


class KeyPair(NamedTuple):
    """Keys (fnmatch globs over dotted keys) that do nothing while ``idle(cfg)`` holds on the resolved config;
    ``why`` completes "<key> = <value> has no effect ...", naming the key they need. ``refuse``: a ConfigError
    instead of a warning, where the run would silently compute something else than what the key asks for."""

    keys: tuple[str, ...]
    idle: Callable[[Any], bool]
    why: str
    refuse: bool = False


# Keys resolve() derives or the trainer fills in: their value away from the default says nothing about what a
# user set, so no pair looks at them.
DERIVED_KEYS = (
    "critic.enable",
    "critic.model.path",
    "critic.ppo_mini_batch_size",
    "critic.ppo_epochs",
    "critic.strategy",
    "actor_rollout_ref.ref.strategy",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
    "*model.dtype",
    "actor_rollout_ref.rollout.dtype",
    "actor_rollout_ref.rollout.seed",
    "actor_rollout_ref.rollout.max_model_len",
    "data.seed",
    "*optim.total_training_steps",
    "trainer.device",
)
_ACTOR, _ROLLOUT, _REF = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref"
_RM, _TWO_STAGE = "reward_model", "reward_model.two_stage"
_NEEDS_VAL = "without data.val_files (no validation runs)"


def _lora_pair(model: str, *more: str) -> KeyPair:
    return KeyPair(
        (f"{model}.lora_alpha", f"{model}.target_modules", *more),
        lambda cfg: get_key(cfg, f"{model}.lora_rank") == 0,
        f"without {model}.lora_rank > 0 (LoRA is off: every weight trains)",
    )


def _fsdp_pair(section: str, strategy: str) -> KeyPair:
    return KeyPair(
        (f"{section}.fsdp_config.*",),
        lambda cfg: get_key(cfg, strategy) != "fsdp2",
        f"without {strategy}=fsdp2",
    )


def _budget_pair(budget: str, switch: str) -> KeyPair:
    return KeyPair((budget,), lambda cfg: not get_key(cfg, switch), f"without {switch}=true")


def _needs_ref(cfg: Any) -> bool:
    return bool(cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)


#: The PPO schema's keys that do nothing without another (first matching pair wins, so the most basic comes
#: first): each warns (UnusedKeyWarning) when set away from its default, or is refused; ``hybridflow doctor``
#: lists them on its config line.
KEY_PAIRS: tuple[KeyPair, ...] = (
    KeyPair(
        (f"{_RM}.dummy",),
        lambda cfg: not cfg.reward_model.enable,
        f"without {_RM}.enable=true: the rule scorers (or custom_reward_function) would score instead",
        refuse=True,
    ),
    KeyPair(
        (f"{_RM}.model.*", f"{_RM}.micro_batch_size_per_gpu", f"{_RM}.input_format", f"{_TWO_STAGE}.*"),
        lambda cfg: not cfg.reward_model.enable,
        f"without {_RM}.enable=true",
    ),
    KeyPair(
        (f"{_RM}.model.*",), lambda cfg: cfg.reward_model.dummy, f"with {_RM}.dummy=true (it loads no model)"
    ),
    KeyPair(
        (f"{_TWO_STAGE}.top_k_ratio", f"{_TWO_STAGE}.threshold", f"{_TWO_STAGE}.unselected*"),
        lambda cfg: not cfg.reward_model.two_stage.enable,
        f"without {_TWO_STAGE}.enable=true",
    ),
    KeyPair(
        (f"{_TWO_STAGE}.top_k_ratio",),
        lambda cfg: cfg.reward_model.two_stage.threshold is not None,
        f"with {_TWO_STAGE}.threshold set (the threshold selects instead)",
    ),
    KeyPair(
        (f"{_TWO_STAGE}.unselected_scale",),
        lambda cfg: cfg.reward_model.two_stage.unselected != "scale",
        f"without {_TWO_STAGE}.unselected=scale",
    ),
    KeyPair(
        ("custom_reward_function.name",),
        lambda cfg: cfg.custom_reward_function.path is None,
        "without custom_reward_function.path",
    ),
    KeyPair(
        (f"{_ROLLOUT}.weight_sync_bucket_mb",),
        lambda cfg: cfg.trainer.backend != "ray",
        "without trainer.backend=ray (the weight link to a rollout worker of its own is Ray's; the local "
        "backend hands the weights over inside its one process)",
    ),
    KeyPair(
        ("async_training.max_staleness", "async_training.partial_rollout"),
        lambda cfg: cfg.async_training.mode != "fully_async",
        "without async_training.mode=fully_async (one_step_off is always one step behind, sync never)",
    ),
    _lora_pair("actor_rollout_ref.model", f"{_ACTOR}.checkpoint.save_lora_only"),
    _fsdp_pair(_ACTOR, f"{_ACTOR}.strategy"),
    KeyPair(
        (f"{_ROLLOUT}.sharded_generation",),
        lambda cfg: (
            cfg.actor_rollout_ref.actor.strategy != "fsdp2" or cfg.actor_rollout_ref.rollout.name != "hf"
        ),
        f"without {_ACTOR}.strategy=fsdp2 and {_ROLLOUT}.name=hf",
    ),
    _budget_pair(f"{_ACTOR}.ppo_max_token_len_per_gpu", f"{_ACTOR}.use_dynamic_bsz"),
    _budget_pair(f"{_ROLLOUT}.log_prob_max_token_len_per_gpu", f"{_ROLLOUT}.log_prob_use_dynamic_bsz"),
    KeyPair(
        (f"{_ACTOR}.kl_loss_coef", f"{_ACTOR}.kl_loss_type"),
        lambda cfg: not cfg.actor_rollout_ref.actor.use_kl_loss,
        f"without {_ACTOR}.use_kl_loss=true",
    ),
    KeyPair(
        ("algorithm.kl_penalty", "algorithm.kl_ctrl.*"),
        lambda cfg: not cfg.algorithm.use_kl_in_reward,
        "without algorithm.use_kl_in_reward=true",
    ),
    KeyPair(
        ("algorithm.kl_ctrl.horizon", "algorithm.kl_ctrl.target_kl"),
        lambda cfg: cfg.algorithm.kl_ctrl.type != "adaptive",
        "without algorithm.kl_ctrl.type=adaptive",
    ),
    KeyPair(
        (f"{_REF}.*",),
        lambda cfg: not _needs_ref(cfg),
        f"without a reference policy, which only {_ACTOR}.use_kl_loss=true or algorithm.use_kl_in_reward=true "
        "loads",
    ),
    KeyPair(
        (f"{_REF}.fsdp_config.*",),
        lambda cfg: cfg.actor_rollout_ref.model.lora_rank > 0,
        "with actor_rollout_ref.model.lora_rank > 0 (the reference is the actor's module, adapter off)",
    ),
    _fsdp_pair(_REF, f"{_REF}.strategy"),
    _budget_pair(f"{_REF}.log_prob_max_token_len_per_gpu", f"{_REF}.log_prob_use_dynamic_bsz"),
    KeyPair(
        ("critic.*",),
        lambda cfg: not cfg.critic.enable,
        "without a critic (critic.enable=true, or algorithm.adv_estimator=gae)",
    ),
    _fsdp_pair("critic.model", "critic.strategy"),
    _budget_pair("critic.ppo_max_token_len_per_gpu", "critic.use_dynamic_bsz"),
    KeyPair(
        (f"{_ACTOR}.off_policy_mask_bounds",),
        lambda cfg: cfg.actor_rollout_ref.actor.off_policy_mask == "off",
        f"without {_ACTOR}.off_policy_mask (token, sequence or token_and_sequence)",
    ),
    KeyPair(
        (
            "data.val_batch_size",
            "trainer.test_freq",
            "trainer.log_val_generations",
            "trainer.val_before_train",
        ),
        lambda cfg: not cfg.data.val_files,
        _NEEDS_VAL,
    ),
    KeyPair((f"{_ROLLOUT}.val_kwargs.*",), lambda cfg: not cfg.data.val_files, _NEEDS_VAL),
    KeyPair(
        (
            f"{_ROLLOUT}.val_kwargs.temperature",
            f"{_ROLLOUT}.val_kwargs.top_p",
            f"{_ROLLOUT}.val_kwargs.top_k",
        ),
        lambda cfg: not cfg.actor_rollout_ref.rollout.val_kwargs.do_sample,
        f"with {_ROLLOUT}.val_kwargs.do_sample=false (validation decodes greedily)",
    ),
    KeyPair(
        (f"{_ROLLOUT}.top_p", f"{_ROLLOUT}.top_k"),
        lambda cfg: not cfg.actor_rollout_ref.rollout.do_sample,
        f"with {_ROLLOUT}.do_sample=false (greedy decoding)",
    ),
    KeyPair(("data.sft.*",), lambda cfg: not cfg.data.sft.files, "without data.sft.files"),
    KeyPair(
        (f"{_ROLLOUT}.multi_turn.*",),
        lambda cfg: not cfg.actor_rollout_ref.rollout.multi_turn.enable,
        f"without {_ROLLOUT}.multi_turn.enable=true",
    ),
    KeyPair(
        (f"{_ROLLOUT}.served_agent.*",),
        lambda cfg: cfg.actor_rollout_ref.rollout.served_agent.path is None,
        f"without {_ROLLOUT}.served_agent.path",
    ),
    KeyPair(
        ("replay_buffer.*",), lambda cfg: not cfg.replay_buffer.enable, "without replay_buffer.enable=true"
    ),
    KeyPair(
        ("trainer.ray_kwargs", "trainer.cpus_per_worker"),
        lambda cfg: cfg.trainer.backend != "ray",
        "without trainer.backend=ray",
    ),
)

#: The offline trainers' (SFT, DPO, KTO) pairs.
OFFLINE_KEY_PAIRS: tuple[KeyPair, ...] = (
    _lora_pair("model"),
    KeyPair(
        ("data.max_token_len_per_gpu",),
        lambda cfg: not cfg.data.use_dynamic_bsz,
        "without data.use_dynamic_bsz=true",
    ),
    KeyPair(
        ("trainer.test_freq", "trainer.val_before_train"), lambda cfg: not cfg.data.val_files, _NEEDS_VAL
    ),
)


def _leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` of every leaf of a config section, in schema order."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


def unused_keys(cfg: Any, defaults: Any, pairs: tuple[KeyPair, ...]) -> list[tuple[str, Any, KeyPair]]:
    """``(key, value, pair)`` of every key set away from ``defaults`` that has no effect in ``cfg`` (resolved)."""
    found = []
    for key, value in _leaves(cfg):
        if any(fnmatch.fnmatchcase(key, d) for d in DERIVED_KEYS) or value == get_key(defaults, key):
            continue
        pair = next(
            (p for p in pairs if any(fnmatch.fnmatchcase(key, k) for k in p.keys) and p.idle(cfg)), None
        )
        if pair is not None:
            found.append((key, value, pair))
    return found


def check_key_pairs(cfg: Any, defaults: Any, pairs: tuple[KeyPair, ...] = KEY_PAIRS) -> None:
    """A ConfigError for the first refused key that has no effect, an UnusedKeyWarning for each other one."""
    found = unused_keys(cfg, defaults, pairs)
    for key, value, pair in found:
        if pair.refuse:
            raise ConfigError(f"{key}={_text(value)} has no effect {pair.why}")
    for key, value, pair in found:
        warnings.warn(f"{key} = {value!r} has no effect {pair.why}", UnusedKeyWarning, stacklevel=3)


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
