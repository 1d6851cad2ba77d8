"""Advantage estimators with a discounted return (GAE, REINFORCE++, ReMax) and ``compute_advantage``, which
runs any registered estimator (the group-baseline ones are in ``group_advantages``, the registry in
``estimators``).

Shapes: token tensors are ``(bs, response_length)``; ``response_mask`` is 1 on response tokens (float or
bool); ``index`` is a numpy array of ``bs`` hashable group ids (the prompt ``uid``: responses to the same
prompt form a group). Every estimator returns ``(advantages, returns)``, both ``(bs, response_length)`` and
zero on padding.

Calling convention (how ``compute_advantage`` calls any registered estimator, including yours): the
estimator's parameters are resolved BY NAME, in this order:

1. the configuration passed to ``compute_advantage``: ``gamma``, ``lam``, ``norm_adv_by_std_in_grpo`` and
   any extra keyword argument (e.g. ``epsilon``); config a function does not name is ignored;
2. ``data.batch[name]`` (e.g. ``token_level_rewards``, ``response_mask``, ``values``, ``reward_baselines``);
3. ``data.non_tensor_batch[name]``; the parameter ``index`` reads ``data.non_tensor_batch["uid"]``;
4. a parameter named ``config`` gets the algorithm config as verl passes it (``config.gamma``,
   ``config["norm_adv_by_std_in_grpo"]``, its ``get``: a ``ConfigView``), so an estimator written for verl runs
   unchanged.

A parameter with a default may be absent; a required one that is absent is a KeyError naming the key and
the estimator. So a new estimator is one decorated function::

    @register_adv_est("my_est")
    def my_est(token_level_rewards, response_mask, index, gamma=1.0):
        ...
        return advantages, returns
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from hybridflow.algorithms.config_view import ConfigView
from hybridflow.algorithms.estimators import (
    AdvantageEstimator,
    AdvEstimatorFn,
    get_adv_estimator_fn,
    register_adv_est,
)
from hybridflow.algorithms.group_advantages import broadcast_to_tokens
from hybridflow.algorithms.utils import masked_whiten, sequence_to_token_scores

if TYPE_CHECKING:
    from hybridflow.protocol import DataProto

# Estimator parameter name -> the data key it is read from, where the two differ.
_PARAM_TO_KEY = {"index": "uid"}


def _gae_recursion(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> torch.Tensor:
    """Un-whitened GAE advantages ``(bs, T)``, zero on padding; the one backward recursion of this module.

    ``delta_t = r_t + gamma * V_{t'} - V_t`` where ``t'`` is the next response position (nothing after
    the last), ``A_t = delta_t + gamma * lam * A_{t'}``. A masked-out position carries the next value and
    advantage through unchanged, so padding (or non-response tokens inside a response, e.g. tool output)
    neither starts nor breaks the recursion. With ``values = 0`` and ``lam = 1`` this is the discounted
    reward-to-go ``G_t = r_t + gamma * G_{t'}``.
    """
    mask = response_mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = m * (delta + gamma * lam * next_advantage) + (1 - m) * next_advantage
        next_value = m * values[:, t] + (1 - m) * next_value
        advantages[:, t] = next_advantage
    return advantages * mask


def _reward_to_go(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """Discounted ``G_t = r_t + gamma * G_{t'}`` over response tokens: ``(bs, T) -> (bs, T)``, 0 on padding."""
    no_values = torch.zeros_like(token_level_rewards)
    return _gae_recursion(token_level_rewards, no_values, response_mask, gamma, lam=1.0)


@register_adv_est(AdvantageEstimator.GAE)
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) with a learned critic ``values`` ``(bs, T)``.

    Returns ``(advantages, returns)``: returns ``A + V`` are the critic's regression targets, advantages
    are whitened over the mask (batch-level normalisation). Both ``(bs, T)`` and 0 on padding.
    """
    with torch.no_grad():
        mask = response_mask.to(values.dtype)
        advantages = _gae_recursion(token_level_rewards, values, mask, gamma, lam)
        returns = (advantages + values) * mask
        return masked_whiten(advantages, mask) * mask, returns


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS)
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: Mapping[str, Any] | None = None,
    gamma: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted reward-to-go per token, whitened over the whole batch.

    The discount is ``config.gamma`` as in verl (or ``gamma`` when there is no config).
    Returns ``(whitened advantages, discounted returns)``, both ``(bs, T)``, 0 on padding.
    """
    gamma = ConfigView(config).gamma if config is not None else gamma  # a dict, verl's config or a view
    if gamma is None:
        raise ValueError("reinforce_plus_plus needs a discount: pass config (with gamma) or gamma")
    with torch.no_grad():
        returns = _reward_to_go(token_level_rewards, response_mask, gamma)
        return masked_whiten(returns, response_mask) * response_mask.to(returns.dtype), returns


@register_adv_est(AdvantageEstimator.REMAX)
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
    config: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): reward-to-go minus the reward of the greedy response, no whitening.

    ``reward_baselines`` ``(bs,)`` holds the score of each prompt's greedy response.
    Returns ``(advantages, undiscounted returns)``, both ``(bs, T)``, 0 on padding.
    """
    with torch.no_grad():
        returns = _reward_to_go(token_level_rewards, response_mask, gamma=1.0)
        baseline = broadcast_to_tokens(reward_baselines.reshape(-1).to(returns.dtype), response_mask)
        return returns - baseline, returns


def _estimator_inputs(
    fn: AdvEstimatorFn, name: str, data: DataProto, config: dict[str, Any], view: ConfigView
) -> dict[str, Any]:
    """Keyword arguments for estimator ``fn``, resolved by parameter name (see the module docstring)."""
    batch_keys = set(data.batch.keys()) if data.batch is not None else set()
    kwargs: dict[str, Any] = {}
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            continue
        key = _PARAM_TO_KEY.get(param.name, param.name)
        if param.name in config:
            kwargs[param.name] = config[param.name]
        elif param.name == "config":
            kwargs[param.name] = view
        elif key in batch_keys:
            kwargs[param.name] = data.tensors[key]
        elif key in data.non_tensor_batch:
            kwargs[param.name] = data.non_tensor_batch[key]
        elif param.default is param.empty:
            raise KeyError(
                f"advantage estimator {name!r} needs {key!r} (parameter {param.name!r}); it is neither in "
                f"data.batch {sorted(batch_keys)} nor in data.non_tensor_batch {sorted(data.non_tensor_batch)}"
            )
    return kwargs


def _place_sequence_rewards(data: DataProto) -> None:
    """``token_level_rewards`` of shape ``(bs,)`` (one reward per sequence) -> ``(bs, T)`` on the last
    response token; any other shape that is not ``response_mask``'s is an error that says which to give."""
    if (
        data.batch is None
        or "token_level_rewards" not in data.batch.keys()
        or "response_mask" not in data.batch.keys()
    ):
        return
    rewards, mask = data.batch["token_level_rewards"], data.batch["response_mask"]
    if rewards.dim() == 1:
        data.batch["token_level_rewards"] = sequence_to_token_scores(rewards.float(), mask)
    elif rewards.shape != mask.shape:
        raise ValueError(
            f"token_level_rewards has shape {tuple(rewards.shape)}; give one reward per sequence "
            f"({mask.shape[0]},) or one per response token {tuple(mask.shape)} like response_mask"
        )


def compute_response_mask(data: DataProto) -> torch.Tensor:
    """``(bs, response_length)``: the part of ``attention_mask`` (prompt + response) over ``responses``."""
    keys = set(data.batch.keys()) if data.batch is not None else set()
    if not {"responses", "attention_mask"} <= keys:
        raise KeyError(
            f"response_mask is missing and cannot be derived without responses and attention_mask; data.batch has {sorted(keys)}"
        )
    mask: torch.Tensor = data.tensors["attention_mask"][:, -data.tensors["responses"].shape[1] :]
    return mask


def compute_advantage(
    data: DataProto,
    adv_estimator: str | AdvantageEstimator,
    gamma: float = 1.0,
    lam: float = 1.0,
    num_repeat: int = 1,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kw: Any,
) -> DataProto:
    """Run the estimator registered as ``adv_estimator`` on ``data`` and store its outputs (verl's
    ``ray_trainer.compute_advantage``, same arguments; ``num_repeat`` is accepted and unused, as in verl).

    Reads ``token_level_rewards`` ``(bs, T)`` (or one reward per sequence ``(bs,)``, which is placed on each
    row's last response token, the usual rule, and stored back as ``(bs, T)``), ``response_mask`` ``(bs, T)``
    (derived from ``attention_mask`` and ``responses`` when absent, as verl does) and whatever else the
    estimator names (``values``, ``reward_baselines``, ``index`` = ``non_tensor_batch["uid"]``). ``config``
    (the algorithm section: a dataclass or dict) reaches estimators that take a ``config`` parameter; ``kw``
    is extra estimator configuration (e.g. ``epsilon``). Writes ``advantages`` and ``returns`` ``(bs, T)``
    into ``data.batch`` and returns ``data``. Raises ValueError for an unknown estimator and KeyError for a
    missing input.
    """
    fn = get_adv_estimator_fn(adv_estimator)
    if data.batch is not None and "response_mask" not in data.batch.keys():
        data.batch["response_mask"] = compute_response_mask(data)
    _place_sequence_rewards(data)
    settings = {"gamma": gamma, "lam": lam, "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo, **kw}
    view = ConfigView(config) if config is not None else ConfigView(settings)
    advantages, returns = fn(**_estimator_inputs(fn, str(adv_estimator), data, settings, view))
    data.tensors["advantages"] = advantages
    data.tensors["returns"] = returns
    return data
