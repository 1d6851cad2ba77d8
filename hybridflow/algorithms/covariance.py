"""Entropy control by covariance (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
Reasoning Language Models"): Clip-Cov and KL-Cov, registered policy losses ``clip_cov`` and ``kl_cov``
(verl's ``loss_mode`` values).

The paper shows that a policy's entropy falls, step by step, by the covariance between a token's log-prob
and its advantage: confident tokens that are rewarded get more confident. A few tokens with a very large
covariance drive most of the collapse, so both losses act on a tiny share ``r`` of the batch's tokens, chosen
by their centred product ``cov_i = (log pi(y_i) - mean log pi) * (A_i - mean A)`` over the response tokens:

- **Clip-Cov** (``clip_cov``): among the tokens with ``clip_cov_lb < cov_i < clip_cov_ub`` that PPO's clip
  leaves alone, ``max(1, int(r * N))`` drawn at random lose their gradient (their loss is 0); the rest get
  PPO's clipped loss.
- **KL-Cov** (``kl_cov``): the ``max(1, int(r * N))`` tokens of largest covariance get the unclipped loss
  ``-A * ratio`` plus ``ppo_kl_coef * |log pi - log pi_old|``; the rest ``-A * ratio``. No ratio clip.

Both follow verl's implementation and calling convention (no dual clip; their settings are read from
``config.policy_loss``: ``clip_cov_ratio``, ``clip_cov_lb``, ``clip_cov_ub``, ``kl_cov_ratio``,
``ppo_kl_coef``; the draw uses torch's global generator, which the workers seed, so a seeded run repeats). ``pg_clipfrac`` is the share of response tokens the covariance selected, as
in verl; ``ppo_kl`` is the usual mean of ``log pi_old - log pi``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hybridflow.algorithms.losses import (
    _MAX_LOG_RATIO,
    _clip_bounds,
    _pg_metrics,
    _required,
    agg_loss,
    register_policy_loss,
)
from hybridflow.algorithms.utils import masked_mean


def token_covariance(log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``cov_i = (log pi_i - mean log pi) * (A_i - mean A)`` per token ``(bs, T)``, means over the response
    tokens of the batch; detached (it selects tokens, it is not differentiated)."""
    log_prob = log_prob.detach()
    return (log_prob - masked_mean(log_prob, mask)) * (advantages - masked_mean(advantages, mask))


def _selected(count: float, candidates: torch.Tensor) -> int:
    return min(max(int(count), 1), int(candidates.sum()))


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov: PPO's clipped loss (epsilons from ``config.clip_ratio*``), with the gradient of
    ``max(1, int(clip_cov_ratio * N))`` random tokens of covariance in ``(clip_cov_lb, clip_cov_ub)`` cut
    (``N``: response tokens; tokens PPO already clips are not candidates). Inputs ``(bs, T)``;
    ``actor/pg_clipfrac`` is the share of response tokens cut by the covariance."""
    config = _required(config, "clip_cov")
    options = config.policy_loss
    if options.clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {options.clip_cov_ratio}")
    mask = response_mask.bool()
    log_ratio = log_prob - old_log_prob
    ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
    low, high = _clip_bounds(config)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - low, 1 + high)
    cov = token_covariance(log_prob, advantages, response_mask)
    candidates = mask & ~(clipped > unclipped) & (cov > options.clip_cov_lb) & (cov < options.clip_cov_ub)
    where = torch.nonzero(candidates)
    chosen = where[torch.randperm(len(where))[: _selected(options.clip_cov_ratio * mask.sum(), candidates)]]
    keep = torch.ones_like(advantages)
    keep[chosen[:, 0], chosen[:, 1]] = 0.0
    losses = torch.maximum(unclipped, clipped) * keep
    losses = losses if rollout_is_weights is None else losses * rollout_is_weights
    clipfrac = masked_mean((keep == 0).float(), response_mask)
    pg_loss = agg_loss(losses, response_mask, loss_agg_mode, **config.global_batch_info)
    return pg_loss, _pg_metrics(clipfrac, masked_mean(-log_ratio, response_mask), 0.0)


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov: ``-A * ratio`` for every token, plus ``ppo_kl_coef * |log pi - log pi_old|`` on the
    ``max(1, int(kl_cov_ratio * N))`` tokens of largest covariance (no clip). Inputs ``(bs, T)``;
    ``actor/pg_clipfrac`` is the share of response tokens penalised."""
    config = _required(config, "kl_cov")
    options = config.policy_loss
    if options.kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {options.kl_cov_ratio}")
    mask = response_mask.bool()
    log_ratio = log_prob - old_log_prob
    ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
    cov = token_covariance(log_prob, advantages, response_mask).masked_fill(~mask, -torch.inf)
    top = torch.topk(cov.flatten(), _selected(options.kl_cov_ratio * mask.sum(), mask)).indices
    penalised = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
    penalised[top] = True
    penalised = penalised.view_as(cov)
    losses = -advantages * ratio + penalised * options.ppo_kl_coef * log_ratio.abs()
    losses = losses if rollout_is_weights is None else losses * rollout_is_weights
    clipfrac = masked_mean(penalised.float(), response_mask)
    pg_loss = agg_loss(losses, response_mask, loss_agg_mode, **config.global_batch_info)
    return pg_loss, _pg_metrics(clipfrac, masked_mean(-log_ratio, response_mask), 0.0)
