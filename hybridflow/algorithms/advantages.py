"""Advantage estimators (GAE, GRPO, RLOO, REINFORCE++, REINFORCE++ with baseline, ReMax) and their registry.

Shapes: token tensors are ``(bs, response_length)``; ``response_mask`` is 1 on response tokens (float or
bool); ``index`` is a numpy array of ``bs`` hashable group ids (the prompt ``uid``: responses to the same
prompt form a group). Every estimator returns ``(advantages, returns)``, both ``(bs, response_length)`` and
zero on padding.

Calling convention (how ``compute_advantage`` calls any registered estimator, including yours): the
estimator's parameters are resolved BY NAME, in this order:

1. the configuration passed to ``compute_advantage``: ``gamma``, ``lam``, ``norm_adv_by_std_in_grpo`` and
   any extra keyword argument (e.g. ``epsilon``); config a function does not name is ignored;
2. ``data.batch[name]`` (e.g. ``token_level_rewards``, ``response_mask``, ``values``, ``reward_baselines``);
3. ``data.non_tensor_batch[name]``; the parameter ``index`` reads ``data.non_tensor_batch["uid"]``.

A parameter with a default may be absent; a required one that is absent is a KeyError naming the key and
the estimator. So a new estimator is one decorated function::

    @register_adv_est("my_est")
    def my_est(token_level_rewards, response_mask, index, gamma=1.0):
        ...
        return advantages, returns
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hybridflow.algorithms.registry import Registry
from hybridflow.algorithms.utils import masked_whiten, sequence_to_token_scores

if TYPE_CHECKING:
    from hybridflow.protocol import DataProto

AdvEstimatorFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

_ADV_ESTIMATORS: Registry[AdvEstimatorFn] = Registry("advantage estimator")

# Estimator parameter name -> the data key it is read from, where the two differ.
_PARAM_TO_KEY = {"index": "uid"}


def register_adv_est(name: str) -> Callable[[AdvEstimatorFn], AdvEstimatorFn]:
    """Decorator registering an advantage estimator under ``name`` (see the module docstring)."""
    return _ADV_ESTIMATORS.register(name)


def get_adv_estimator_fn(name: str) -> AdvEstimatorFn:
    """The estimator registered as ``name``; ValueError listing the known names otherwise."""
    return _ADV_ESTIMATORS.get(name)


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


@register_adv_est("gae")
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


def _group_ids(index: Any, bs: int) -> torch.Tensor:
    """Dense group numbers ``(bs,)`` for arbitrary hashable ids, in order of first appearance."""
    ids = list(index)  # not np.asarray: tuple ids would become a 2-D array
    if len(ids) != bs:
        raise ValueError(f"index has {len(ids)} group ids but the batch has {bs} rows")
    dense: dict[Any, int] = {}
    return torch.tensor([dense.setdefault(i, len(dense)) for i in ids], dtype=torch.long)


def _sequence_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Outcome score per sequence ``(bs,)``: the sum of its response tokens' rewards."""
    return (token_level_rewards * response_mask.to(token_level_rewards.dtype)).sum(dim=-1)


def _group_stats(scores: torch.Tensor, index: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row ``(group mean, group std, group size)``, each ``(bs,)``, for ``scores`` ``(bs,)``.

    The std is unbiased (like ``torch.std``). A group of one has no baseline to compare with: its mean is
    reported as 0 and its std as 1, so its advantage is its raw score.
    """
    ids = _group_ids(index, scores.shape[0])
    size = torch.bincount(ids).to(scores.dtype)
    mean = torch.zeros_like(size).index_add_(0, ids, scores) / size
    square_dev = torch.zeros_like(size).index_add_(0, ids, (scores - mean[ids]) ** 2)
    std = (square_dev / (size - 1).clamp_min(1)).sqrt()
    alone = size == 1
    mean = torch.where(alone, 0.0, mean)
    std = torch.where(alone, 1.0, std)
    return mean[ids], std[ids], size[ids]


def _broadcast_to_tokens(per_sequence: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``(bs,) -> (bs, T)``: the sequence value on every response token, 0 on padding."""
    return per_sequence.unsqueeze(-1) * response_mask.to(per_sequence.dtype)


@register_adv_est("grpo")
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024): each response's score compared with the other responses to its prompt.

    ``A_i = (score_i - mean_group) / (std_group + epsilon)`` on every response token, where ``score_i``
    is the sum of the token rewards. ``norm_adv_by_std_in_grpo=False`` gives Dr.GRPO (Liu et al. 2025),
    which drops the std division because it over-weights groups with nearly equal scores.
    Returns ``(advantages, returns)``, equal, ``(bs, T)``.
    """
    with torch.no_grad():
        scores = _sequence_scores(token_level_rewards, response_mask)
        mean, std, _ = _group_stats(scores, index)
        centered = scores - mean
        normalised = centered / (std + epsilon) if norm_adv_by_std_in_grpo else centered
        advantages = _broadcast_to_tokens(normalised, response_mask)
        return advantages, advantages.clone()


@register_adv_est("rloo")
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): baseline = mean score of the OTHER responses to the same prompt.

    ``A_i = score_i - (sum_group - score_i) / (n - 1)``; a response alone in its group keeps its score.
    Leaving the response out keeps the baseline independent of it (an unbiased gradient estimate).
    Returns ``(advantages, returns)``, equal, ``(bs, T)``.
    """
    with torch.no_grad():
        scores = _sequence_scores(token_level_rewards, response_mask)
        mean, _, size = _group_stats(scores, index)
        others_mean = (size * mean - scores) / (size - 1).clamp_min(1)
        baseline = torch.where(size > 1, others_mean, 0.0)
        advantages = _broadcast_to_tokens(scores - baseline, response_mask)
        return advantages, advantages.clone()


@register_adv_est("reinforce_plus_plus")
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted reward-to-go per token, whitened over the whole batch.

    Returns ``(whitened advantages, discounted returns)``, both ``(bs, T)``, 0 on padding.
    """
    with torch.no_grad():
        returns = _reward_to_go(token_level_rewards, response_mask, gamma)
        return masked_whiten(returns, response_mask) * response_mask.to(returns.dtype), returns


@register_adv_est("reinforce_plus_plus_baseline")
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline: score minus its group mean, then whitened over the batch.

    Unlike GRPO the scale comes from the whole batch, not from each group's std.
    Returns ``(advantages, returns)``, equal, ``(bs, T)``.
    """
    with torch.no_grad():
        scores = _sequence_scores(token_level_rewards, response_mask)
        mean, _, _ = _group_stats(scores, index)
        centered = _broadcast_to_tokens(scores - mean, response_mask)
        advantages = masked_whiten(centered, response_mask) * response_mask.to(centered.dtype)
        return advantages, advantages.clone()


@register_adv_est("remax")
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor, reward_baselines: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): reward-to-go minus the reward of the greedy response, no whitening.

    ``reward_baselines`` ``(bs,)`` holds the score of each prompt's greedy response.
    Returns ``(advantages, undiscounted returns)``, both ``(bs, T)``, 0 on padding.
    """
    with torch.no_grad():
        returns = _reward_to_go(token_level_rewards, response_mask, gamma=1.0)
        baseline = _broadcast_to_tokens(reward_baselines.reshape(-1).to(returns.dtype), response_mask)
        return returns - baseline, returns


def _estimator_inputs(
    fn: AdvEstimatorFn, name: str, data: DataProto, config: dict[str, Any]
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
        elif key in batch_keys:
            kwargs[param.name] = data.batch[key]
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


def compute_advantage(
    data: DataProto,
    adv_estimator: str,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    **kw: Any,
) -> DataProto:
    """Run the estimator registered as ``adv_estimator`` on ``data`` and store its outputs.

    Reads ``token_level_rewards`` ``(bs, T)`` (or one reward per sequence ``(bs,)``, which is placed on each
    row's last response token, the usual rule, and stored back as ``(bs, T)``), ``response_mask`` ``(bs, T)``
    and whatever else the
    estimator names (``values``, ``reward_baselines``, ``index`` = ``non_tensor_batch["uid"]``); ``kw`` is
    extra estimator configuration (e.g. ``epsilon``). Writes ``advantages`` and ``returns`` ``(bs, T)`` into
    ``data.batch`` and returns ``data``. Raises ValueError for an unknown estimator and KeyError for a
    missing input.
    """
    fn = get_adv_estimator_fn(adv_estimator)
    _place_sequence_rewards(data)
    config = {"gamma": gamma, "lam": lam, "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo, **kw}
    advantages, returns = fn(**_estimator_inputs(fn, adv_estimator, data, config))
    data.batch["advantages"] = advantages
    data.batch["returns"] = returns
    return data
