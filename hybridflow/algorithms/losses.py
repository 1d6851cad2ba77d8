"""Losses of the actor (policy gradient, supervised NLL) and the critic, and how token losses are averaged.

Token tensors are ``(bs, response_length)``; ``response_mask`` is 1 on response tokens (float or bool).
Policy losses are chosen by name through ``get_policy_loss_fn`` and are called as verl calls them::

    pg_loss, pg_metrics = get_policy_loss_fn(name)(
        old_log_prob=..., log_prob=..., advantages=..., response_mask=..., loss_agg_mode=...,
        config=actor_config, rollout_is_weights=None)

``config`` is the actor section (read as ``config.clip_ratio``, ``config.clip_ratio_c``,
``config.global_batch_info``: the actor passes a ``ConfigView``), ``pg_metrics`` a dict of floats
(``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``). ``register_policy_loss`` also takes
a function in hybridflow's keyword form, ``fn(old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode, cliprange, cliprange_low, cliprange_high, clip_ratio_c) -> (pg_loss, pg_clipfrac, ppo_kl,
pg_clipfrac_lower)`` (a function without a ``config`` parameter; ``compute_policy_loss`` is one), and
registers it wrapped into the form above.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hybridflow.algorithms.config_view import ConfigView
from hybridflow.algorithms.registry import Registry
from hybridflow.algorithms.utils import entropy_from_logits, masked_mean

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
KeywordPolicyLossFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]

_POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", on_conflict="replace")

#: verl's name for the registry: a live dict, name -> policy loss in verl's form.
POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = _POLICY_LOSSES.entries

# Log-ratios beyond this are numerically meaningless and would overflow exp().
_MAX_LOG_RATIO = 20.0
_AGG_MODES = ["seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-mean"]


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under ``name`` (verl's form, or hybridflow's keyword form: see the
    module docstring). A different function under a taken name replaces it, as in verl, with a warning."""
    return _POLICY_LOSSES.register(name, adapt=_verl_form)


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered as ``name`` (in verl's form); ValueError listing the known names otherwise."""
    return _POLICY_LOSSES.get(name)


def _verl_form(fn: Callable[..., Any]) -> PolicyLossFn:
    """``fn`` itself when it takes ``config`` (verl's form), else ``fn`` (keyword form) wrapped into it."""
    if "config" in inspect.signature(fn).parameters:
        return fn

    @functools.wraps(fn)
    def wrapped(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Mapping[str, Any] | None = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        view = _required(config, fn.__name__)
        low, high = _clip_bounds(view)
        if rollout_is_weights is not None:  # positive weights scale each token's clipped loss alike
            advantages = advantages * rollout_is_weights
        pg_loss, clipfrac, ppo_kl, clipfrac_lower = fn(
            old_log_prob=old_log_prob,
            log_prob=log_prob,
            advantages=advantages,
            response_mask=response_mask,
            loss_agg_mode=loss_agg_mode,
            cliprange=view.clip_ratio,
            cliprange_low=low,
            cliprange_high=high,
            clip_ratio_c=view.clip_ratio_c,
        )
        return pg_loss, _pg_metrics(clipfrac, ppo_kl, clipfrac_lower)

    return wrapped


def _required(config: Any, loss: str) -> ConfigView:
    """``config`` readable both ways (``config.clip_ratio``, ``config["clip_ratio"]``), with verl's
    ``global_batch_info`` (whole-batch counts; none: this micro-batch's own) when it has none; None is an error."""
    if config is None:
        raise ValueError(f"policy loss {loss!r} needs config (the actor section: clip_ratio, ...), got None")
    view = config if isinstance(config, ConfigView) else ConfigView(config)
    return view if "global_batch_info" in view else ConfigView(view, global_batch_info={})


def _clip_bounds(config: ConfigView) -> tuple[float, float]:
    """``(low, high)`` clip epsilons: ``clip_ratio_low``/``clip_ratio_high``, each defaulting to ``clip_ratio``."""
    low, high = config.clip_ratio_low, config.clip_ratio_high
    return (config.clip_ratio if low is None else low), (config.clip_ratio if high is None else high)


def _pg_metrics(clipfrac: Any, ppo_kl: Any, clipfrac_lower: Any) -> dict[str, float]:
    def number(value: Any) -> float:
        return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)

    return {
        "actor/pg_clipfrac": number(clipfrac),
        "actor/ppo_kl": number(ppo_kl),
        "actor/pg_clipfrac_lower": number(clipfrac_lower),
    }


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a token loss ``(bs, T)`` to a scalar; the mode decides how long responses are weighted.

    - "token-mean": mean over all response tokens of the batch (long responses weigh more).
    - "seq-mean-token-sum": each response's token sum, averaged over responses.
    - "seq-mean-token-mean": each response's token mean, averaged over responses (GRPO paper).
    - "seq-mean-token-sum-norm": each response's token sum divided by a constant ``loss_scale_factor``
      (default the horizon ``T = loss_mat.shape[-1]``), averaged over responses (Dr.GRPO: no length bias).

    The "seq-mean" modes average over responses that have at least one token. verl's global normalisation
    is there too: given ``batch_num_tokens`` (token-mean) or ``global_batch_size`` (seq-mean modes), the sum
    over this micro-batch is divided by that count of the whole batch and multiplied by ``dp_size``.
    """
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            return masked_mean(loss_mat, mask)
        return (loss_mat * mask).sum() / batch_num_tokens * dp_size
    token_sums = (loss_mat * mask).sum(dim=-1)
    lengths = mask.sum(dim=-1)
    if loss_agg_mode == "seq-mean-token-sum":
        seq_losses = token_sums
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_losses = token_sums / lengths.clamp_min(1e-8)
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        seq_losses = token_sums / (loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    else:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; known: {_AGG_MODES}")
    if global_batch_size is None:
        return masked_mean(seq_losses, lengths > 0)
    return (seq_losses * (lengths > 0)).sum() / global_batch_size * dp_size


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
    """PPO clipped policy loss with token-level ratios ``pi / pi_old``, all inputs ``(bs, T)``, in the keyword
    form (verl's ``compute_policy_loss``; ``compute_policy_loss_vanilla`` is the registered form).

    The ratio is clipped to ``[1 - cliprange_low, 1 + cliprange_high]`` (each defaults to ``cliprange``;
    a larger high bound is DAPO's clip-higher, which keeps exploring low-probability tokens), and for
    negative advantages the loss is dual-clipped at ``-A * clip_ratio_c``.
    Returns scalars ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``, where ``ppo_kl`` is the masked
    mean of ``old_log_prob - log_prob``.
    """
    losses, clipfrac, ppo_kl, clipfrac_lower = _ppo_token_losses(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        cliprange_low,
        cliprange_high,
        clip_ratio_c,
        cliprange,
    )
    return agg_loss(losses, response_mask, loss_agg_mode), clipfrac, ppo_kl, clipfrac_lower


def _ppo_token_losses(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_low: float | None,
    cliprange_high: float | None,
    clip_ratio_c: float | None,
    cliprange: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's token losses ``(bs, T)`` and their ``(clipfrac, ppo_kl, clipfrac_lower)``."""
    log_ratio = log_prob - old_log_prob
    ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    losses, clipfrac, clipfrac_lower = _clipped_surrogate(
        ratio, advantages, response_mask, low, high, clip_ratio_c
    )
    return losses, clipfrac, masked_mean(-log_ratio, response_mask), clipfrac_lower


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped, dual-clipped loss (``compute_policy_loss``) in verl's registered form: the clip
    epsilons from ``config.clip_ratio`` / ``clip_ratio_low`` / ``clip_ratio_high``, the dual-clip bound from
    ``config.clip_ratio_c``; ``rollout_is_weights`` ``(bs, T)`` scale each token's loss."""
    view = _required(config, "vanilla")
    low, high = _clip_bounds(view)
    losses, clipfrac, ppo_kl, clipfrac_lower = _ppo_token_losses(
        old_log_prob, log_prob, advantages, response_mask, low, high, view.clip_ratio_c
    )
    losses = losses if rollout_is_weights is None else losses * rollout_is_weights
    pg_loss = agg_loss(losses, response_mask, loss_agg_mode, **view.global_batch_info)
    return pg_loss, _pg_metrics(clipfrac, ppo_kl, clipfrac_lower)


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025): PPO clipping on a sequence-level importance ratio, inputs ``(bs, T)``.

    ``s_i = exp(mean_t log(pi / pi_old))`` over the response (a length-normalised sequence ratio);
    token ``t`` uses ``sg[s_i] * pi_t / sg[pi_t]``, equal to ``s_i`` in value but with the gradient of
    its own token. Clipping whole sequences suits MoE and long responses where token ratios are noisy;
    the ranges are therefore tiny (the paper uses clip_ratio_low 3e-4, clip_ratio_high 4e-4). No dual
    clip. Always averaged "seq-mean-token-mean", the paper's sequence-level mean, whatever
    ``loss_agg_mode`` says (as in verl).
    """
    view = _required(config, "gspo")
    low, high = _clip_bounds(view)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_mean(log_ratio, response_mask, axis=-1).unsqueeze(-1)
    token_log_ratio = seq_log_ratio.detach() + log_prob - log_prob.detach()
    ratio = token_log_ratio.clamp(max=10.0).exp()  # verl's bound on the sequence ratio
    losses, clipfrac, clipfrac_lower = _clipped_surrogate(ratio, advantages, response_mask, low, high, None)
    losses = losses if rollout_is_weights is None else losses * rollout_is_weights
    pg_loss = agg_loss(losses, response_mask, "seq-mean-token-mean", **view.global_batch_info)
    return pg_loss, _pg_metrics(clipfrac, masked_mean(-log_ratio, response_mask), clipfrac_lower)


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GPG (Chu et al. 2025): the plain policy gradient ``-A * log pi`` per token, no ratio and no clip
    (pair it with the ``gpg`` estimator). Returns no metrics, as in verl."""
    losses = -advantages * log_prob
    losses = losses if rollout_is_weights is None else losses * rollout_is_weights
    return agg_loss(losses, response_mask, loss_agg_mode, **_required(config, "gpg").global_batch_info), {}


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GMPO (Zhao et al. 2025): the sequence ratio is the geometric mean of the token ratios, each token's
    log-ratio first clipped to ``[-clip_ratio_low, clip_ratio_high]`` on the side its advantage's sign
    makes pessimistic; ``loss = mean_i(-A_i * ratio_i)`` with ``A_i`` the sequence's mean token advantage
    (``loss_agg_mode`` unused, as in verl). ``rollout_is_weights`` enter as their geometric mean."""
    low, high = _clip_bounds(_required(config, "geo_mean"))
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    clamped = log_ratio.clamp(-low, high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)
    mask = response_mask.to(log_ratio.dtype)
    lengths = mask.sum(dim=-1) + 1e-8
    ratio = ((pessimistic * mask).sum(dim=-1) / lengths).exp()
    losses = -(advantages * mask).sum(dim=-1) / lengths * ratio
    if rollout_is_weights is not None:
        losses = losses * ((rollout_is_weights + 1e-10).log() * mask).sum(dim=-1).div(lengths).exp()
    clipped = (log_ratio != clamped).float()
    clipfrac, clipfrac_lower = (
        masked_mean(clipped * (cond).float(), response_mask) for cond in (advantages > 0, advantages < 0)
    )
    return losses.mean(), _pg_metrics(clipfrac, masked_mean(-log_ratio, response_mask), clipfrac_lower)


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax 2025): ``-sg[clip(ratio, 1 - low, 1 + high)] * A * log pi``: the clipped ratio only
    weights the token (no gradient through it), so a clipped token still gets a gradient, unlike PPO."""
    view = _required(config, "cispo")
    low, high = _clip_bounds(view)
    log_ratio = log_prob - old_log_prob
    ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
    clipped = ratio.clamp(1 - low, 1 + high)
    losses = -clipped.detach() * advantages * log_prob
    losses = losses if rollout_is_weights is None else losses * rollout_is_weights
    pg_loss = agg_loss(losses, response_mask, loss_agg_mode, **view.global_batch_info)
    clipfrac = masked_mean((ratio != clipped).float(), response_mask)
    return pg_loss, _pg_metrics(clipfrac, masked_mean(-log_ratio, response_mask), 0.0)


def compute_entropy_loss(
    logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean"
) -> torch.Tensor:
    """Mean entropy of the token distributions ``logits`` ``(bs, T, vocab)`` over the response, as one
    number (``agg_loss``); the actor subtracts ``entropy_coeff`` times it."""
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode)


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
