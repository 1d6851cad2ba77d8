"""Losses of the actor (policy gradient, supervised NLL) and the critic, and how token losses are averaged.

Token tensors are ``(bs, response_length)``; ``response_mask`` is 1 on response tokens (float or bool).
Policy losses are chosen by name through ``get_policy_loss_fn``; every registered one accepts the same
keyword arguments so the actor can call any of them the same way::

    pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower = get_policy_loss_fn(name)(
        old_log_prob=..., log_prob=..., advantages=..., response_mask=..., loss_agg_mode=...,
        cliprange=..., cliprange_low=..., cliprange_high=..., clip_ratio_c=...)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridflow.algorithms.registry import Registry
from hybridflow.algorithms.utils import masked_mean

PolicyLossFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]

_POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")
# loss name -> the ``actor.policy_loss`` keys the actor passes it as keywords beyond the common ones
_POLICY_LOSS_OPTIONS: dict[str, tuple[str, ...]] = {}

# Log-ratios beyond this are numerically meaningless and would overflow exp().
_MAX_LOG_RATIO = 20.0


def register_policy_loss(name: str, options: tuple[str, ...] = ()) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under ``name``; it must accept the module's common keywords, plus
    ``options``: names of ``actor_rollout_ref.actor.policy_loss`` keys the actor passes it by keyword (e.g.
    Clip-Cov's ``clip_cov_ratio``)."""
    register = _POLICY_LOSSES.register(name)

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        fn = register(fn)  # refuses another function under a taken name before the options change
        _POLICY_LOSS_OPTIONS[name] = tuple(options)
        return fn

    return decorator


def policy_loss_options(name: str) -> tuple[str, ...]:
    """The ``actor.policy_loss`` keys the loss registered as ``name`` takes beyond the common keywords."""
    get_policy_loss_fn(name)
    return _POLICY_LOSS_OPTIONS.get(name, ())


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered as ``name``; ValueError listing the known names otherwise."""
    return _POLICY_LOSSES.get(name)


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """Reduce a token loss ``(bs, T)`` to a scalar; the mode decides how long responses are weighted.

    - "token-mean": mean over all response tokens of the batch (long responses weigh more).
    - "seq-mean-token-sum": each response's token sum, averaged over responses.
    - "seq-mean-token-mean": each response's token mean, averaged over responses (GRPO paper).
    - "seq-mean-token-sum-norm": each response's token sum divided by the constant horizon ``T``
      (``loss_mat.shape[-1]``), averaged over responses (Dr.GRPO: no length bias).

    The "seq-mean" modes average over responses that have at least one token.
    """
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, mask)
    token_sums = (loss_mat * mask).sum(dim=-1)
    lengths = mask.sum(dim=-1)
    if loss_agg_mode == "seq-mean-token-sum":
        seq_losses = token_sums
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_losses = token_sums / lengths.clamp_min(1e-8)
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        seq_losses = token_sums / loss_mat.shape[-1]
    else:
        raise ValueError(
            f"unknown loss_agg_mode {loss_agg_mode!r}; known: ['seq-mean-token-mean', 'seq-mean-token-sum', "
            "'seq-mean-token-sum-norm', 'token-mean']"
        )
    return masked_mean(seq_losses, lengths > 0)


def _clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_low: float,
    cliprange_high: float,
    clip_ratio_c: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's pessimistic clipped objective per token, optionally dual-clipped.

    Returns ``(token losses (bs, T), clipfrac, clipfrac_lower)``: the fraction of response tokens where
    the ratio clip is active, and where the dual clip caps the loss of a negative advantage at
    ``-A * clip_ratio_c`` (Ye et al. 2020), which stops a huge ratio from producing an unbounded loss.
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - cliprange_low, 1 + cliprange_high)
    losses = torch.maximum(unclipped, clipped)
    clipfrac = masked_mean((clipped > unclipped).float(), response_mask)
    if clip_ratio_c is None:
        return losses, clipfrac, torch.zeros_like(clipfrac)
    if clip_ratio_c <= 1.0:
        raise ValueError(
            f"clip_ratio_c must be > 1 (the dual-clip lower bound of the ratio), got {clip_ratio_c}"
        )
    cap = -advantages * clip_ratio_c
    negative = advantages < 0
    clipfrac_lower = masked_mean((negative & (losses > cap)).float(), response_mask)
    return torch.where(negative, torch.minimum(losses, cap), losses), clipfrac, clipfrac_lower


@register_policy_loss("vanilla")
def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float = 0.2,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped policy loss with token-level ratios ``pi / pi_old``, all inputs ``(bs, T)``.

    The ratio is clipped to ``[1 - cliprange_low, 1 + cliprange_high]`` (each defaults to ``cliprange``;
    a larger high bound is DAPO's clip-higher, which keeps exploring low-probability tokens), and for
    negative advantages the loss is dual-clipped at ``-A * clip_ratio_c``.
    Returns scalars ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``, where ``ppo_kl`` is the masked
    mean of ``old_log_prob - log_prob``.
    """
    log_ratio = log_prob - old_log_prob
    ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
    losses, clipfrac, clipfrac_lower = _clipped_surrogate(
        ratio,
        advantages,
        response_mask,
        *_clip_bounds(cliprange, cliprange_low, cliprange_high),
        clip_ratio_c,
    )
    ppo_kl = masked_mean(-log_ratio, response_mask)
    return agg_loss(losses, response_mask, loss_agg_mode), clipfrac, ppo_kl, clipfrac_lower


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float = 3e-4,
    cliprange_low: float | None = None,
    cliprange_high: float | None = 4e-4,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "seq-mean-token-mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025): PPO clipping on a sequence-level importance ratio, inputs ``(bs, T)``.

    ``s_i = exp(mean_t log(pi / pi_old))`` over the response (a length-normalised sequence ratio);
    token ``t`` uses ``sg[s_i] * pi_t / sg[pi_t]``, equal to ``s_i`` in value but with the gradient of
    its own token. Clipping whole sequences suits MoE and long responses where token ratios are noisy;
    the ranges are therefore tiny (the paper uses 3e-4 / 4e-4). No dual clip (``clip_ratio_c`` is
    accepted for the common signature), so ``pg_clipfrac_lower`` is 0. The paper averages with
    "seq-mean-token-mean". Returns ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``.
    """
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_mean(log_ratio, response_mask, axis=-1).unsqueeze(-1)
    token_log_ratio = seq_log_ratio.detach() + log_prob - log_prob.detach()
    ratio = token_log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
    losses, clipfrac, clipfrac_lower = _clipped_surrogate(
        ratio, advantages, response_mask, *_clip_bounds(cliprange, cliprange_low, cliprange_high), None
    )
    ppo_kl = masked_mean(-log_ratio, response_mask)
    return agg_loss(losses, response_mask, loss_agg_mode), clipfrac, ppo_kl, clipfrac_lower


def _clip_bounds(
    cliprange: float, cliprange_low: float | None, cliprange_high: float | None
) -> tuple[float, float]:
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    return low, high


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped critic loss: ``0.5 * max((V - R)^2, (clip(V, V_old +- c) - R)^2)``, inputs ``(bs, T)``.

    ``vpreds`` are the current predictions, ``values`` those at rollout time; clipping keeps one update
    from moving the value estimate far from the data it was fitted to. Returns scalars
    ``(vf_loss, vf_clipfrac)``: the fraction of tokens where the clipped error is the larger one.
    """
    vpreds_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped = (vpreds - returns).square()
    clipped = (vpreds_clipped - returns).square()
    vf_loss = 0.5 * agg_loss(torch.maximum(unclipped, clipped), response_mask, loss_agg_mode)
    return vf_loss, masked_mean((clipped > unclipped).float(), response_mask)


def compute_sft_loss(
    log_prob: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean"
) -> torch.Tensor:
    """Negative log-likelihood of the masked response tokens ``(bs, T) -> ()``.

    Mixing this into RL updates on supervised (e.g. demonstration) data anchors the policy to them.
    """
    return agg_loss(-log_prob, response_mask, loss_agg_mode)


def truncated_importance_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    cap: float,
    level: str = "token",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance sampling (TIS) between the rollout engine and the trainer, all ``(bs, T)``.

    The rollout engine samples from its own numerics (another kernel, stale weights), so the samples come
    from ``pi_rollout``, not the ``pi_old`` the loss assumes. ``level`` ``token`` (Token-TIS) weights each token
    by ``min(pi_old / pi_rollout, cap)``; ``sequence`` (Seq-TIS, verl's ``rollout_is: sequence``) weights every
    token of a sample by ``min(prod_t pi_old / pi_rollout, cap)``, the ratio of the whole sample (unbiased for a
    sequence-level reward, higher variance). The cap bounds the variance that rare tokens would bring. Returns
    ``(weights (bs, T), clipfrac)``: detached weights (1 off the mask) and the share of response tokens (of
    samples, for ``sequence``) whose ratio was capped. Multiplying the advantages by the weights scales each
    token's clipped-surrogate loss by the same factor (the weight is positive)."""
    if cap <= 0:
        raise ValueError(f"tis_imp_ratio_cap must be > 0 to apply TIS, got {cap}")
    if level not in ("token", "sequence"):
        raise ValueError(f"unknown TIS level {level!r}; known: ['sequence', 'token']")
    mask = response_mask.bool()
    log_ratio = (old_log_prob - rollout_log_prob).detach()
    if level == "sequence":
        seq = (log_ratio * mask).sum(dim=-1).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
        has = mask.any(dim=-1)
        clipfrac = masked_mean((seq > cap).float(), has)
        ratio = seq[:, None].expand_as(log_ratio)
    else:
        ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
        clipfrac = masked_mean((ratio > cap).float(), mask)
    return torch.where(mask, ratio.clamp(max=cap), torch.ones_like(ratio)), clipfrac
