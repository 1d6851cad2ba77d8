"""Offline objectives: supervised fine-tuning, DPO (sigmoid / IPO / hinge) and KTO, as tensor functions.

Why here, beside the policy losses: an offline trainer is the same actor update with another loss. Each
objective reads the per-token log-probs the actor computes for any batch laid out like rollouts
(``response_log_probs``: ``(bs, L)`` over the response), the ``response_mask`` of the tokens that count and,
for DPO/KTO, the reference policy's ``ref_log_prob`` from the reference worker. Nothing here knows about
workers, so the hand-computed tests exercise exactly what training runs.

Layouts the objectives expect (the offline datasets produce them):
- DPO: rows interleaved ``[chosen_0, rejected_0, chosen_1, rejected_1, ...]``, so that any even split of
  the rows (micro-batches, data-parallel shards) keeps each pair together.
- KTO: one row per completion with a ``label`` ``(bs,)`` (1 desirable, 0 undesirable); the KL reference
  point ``z0`` (a detached scalar) is estimated by the driver on mismatched prompt/completion pairs.

Preference losses are registered by name (``register_preference_loss``) like the policy losses; each maps
the DPO logits ``h = (log pi(y_w) - log pi(y_l)) - (log ref(y_w) - log ref(y_l))`` (per pair, summed over
tokens) to a per-pair loss.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hybridflow.algorithms.losses import compute_sft_loss
from hybridflow.algorithms.registry import Registry

PreferenceLossFn = Callable[[torch.Tensor, float, float], torch.Tensor]
PREFERENCE_LOSSES: Registry[PreferenceLossFn] = Registry("preference loss")
register_preference_loss = PREFERENCE_LOSSES.register
get_preference_loss_fn = PREFERENCE_LOSSES.get


@register_preference_loss("sigmoid")
def sigmoid_loss(logits: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """DPO (Rafailov et al. 2023): ``-log sigmoid(beta h)``. With ``label_smoothing`` eps the preference
    labels are taken as flipped with probability eps (conservative DPO):
    ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``. ``logits`` ``(B,)`` -> ``(B,)``."""
    return -(1 - label_smoothing) * F.logsigmoid(beta * logits) - label_smoothing * F.logsigmoid(
        -beta * logits
    )


@register_preference_loss("ipo")
def ipo_loss(logits: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """IPO (Azar et al. 2023): ``(h - 1 / (2 beta))^2``, a squared loss that stops pushing once the margin
    reaches its target instead of driving it to infinity (``beta`` is the paper's tau). Sequence log-probs are
    summed, as in the paper (TRL averages them per token for IPO)."""
    _no_smoothing("ipo", label_smoothing)
    return (logits - 1 / (2 * beta)) ** 2


@register_preference_loss("hinge")
def hinge_loss(logits: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """SLiC-style hinge (Zhao et al. 2023): ``max(0, 1 - beta h)``."""
    _no_smoothing("hinge", label_smoothing)
    return torch.relu(1 - beta * logits)


def _no_smoothing(name: str, label_smoothing: float) -> None:
    if label_smoothing:
        raise ValueError(
            f"label_smoothing={label_smoothing} only applies to loss_type 'sigmoid', not {name!r}; "
            "set it to 0"
        )


def sequence_log_probs(log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence log-likelihood ``(bs,)``: the sum of ``log_prob`` ``(bs, L)`` over the masked tokens."""
    return (log_prob * mask).sum(-1)


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO-family losses ``(B,)`` and the implicit rewards ``beta (log pi - log ref)`` of the chosen
    and rejected responses ``(B,)`` each (detached). Inputs are sequence log-probs ``(B,)``."""
    logits = (chosen_logps - rejected_logps) - (ref_chosen_logps - ref_rejected_logps)
    losses = get_preference_loss_fn(loss_type)(logits, beta, label_smoothing)
    chosen_rewards = beta * (chosen_logps - ref_chosen_logps).detach()
    rejected_rewards = beta * (rejected_logps - ref_rejected_logps).detach()
    return losses, chosen_rewards, rejected_rewards


def kto_kl_estimate(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """KTO's reference point ``z0``: the batch mean of ``log pi - log ref`` over *mismatched* prompt/completion
    pairs (a completion scored after another row's prompt), clamped at 0 and detached: an estimate of
    KL(pi || ref) that carries no gradient (Ethayarajh et al. 2024). ``(B,)`` -> scalar."""
    return (logps - ref_logps).mean().clamp(min=0).detach()


def kto_loss(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor | float,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KTO losses ``(B,)`` and implicit rewards ``beta (log pi - log ref)`` ``(B,)`` (detached).

    With ``r = log pi(y|x) - log ref(y|x)``: a desirable row costs ``w_D (1 - sigmoid(beta (r - z0)))``, an
    undesirable one ``w_U (1 - sigmoid(beta (z0 - r)))``; ``desirable`` ``(B,)`` is bool or 0/1."""
    ratio = logps - ref_logps
    desirable = desirable.bool()
    value = torch.where(desirable, torch.sigmoid(beta * (ratio - kl)), torch.sigmoid(beta * (kl - ratio)))
    weights = torch.where(desirable, desirable_weight, undesirable_weight).to(value.dtype)
    return weights * (1 - value), beta * ratio.detach()


def bradley_terry_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_rewards_coefficient: float | None = None,
) -> torch.Tensor:
    """A reward model's per-pair loss ``(B,)`` (Bradley-Terry, as TRL's ``RewardTrainer``):
    ``-log sigmoid(r_chosen - r_rejected - margin)``, plus ``c (r_chosen + r_rejected)^2`` with
    ``center_rewards_coefficient`` c, which pulls the rewards towards mean 0 (Eisenstein et al. 2023); its
    mean over pairs is TRL's loss. ``chosen``, ``rejected``, ``margin``: ``(B,)`` scalar rewards."""
    difference = chosen - rejected
    if margin is not None:
        difference = difference - margin.to(difference.dtype)
    losses = -F.logsigmoid(difference)
    if center_rewards_coefficient:
        losses = losses + center_rewards_coefficient * (chosen + rejected) ** 2
    return losses


# ----------------------------------------------------------------------------- objectives over a batch
Batch = Mapping[str, torch.Tensor]
ObjectiveFn = Callable[[torch.Tensor, Batch, dict[str, Any]], tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class OfflineObjective:
    """A loss over a micro-batch and how the engine weighs micro-batches (``loss_agg_mode``: by tokens for
    SFT, by rows for the sequence-level DPO/KTO losses)."""

    fn: ObjectiveFn
    loss_agg_mode: str
    needs_ref: bool


def _sft_objective(
    log_prob: torch.Tensor, batch: Batch, spec: dict[str, Any]
) -> tuple[torch.Tensor, dict[str, float]]:
    loss = compute_sft_loss(log_prob, batch["response_mask"].float(), "token-mean")
    return loss, {"loss": loss.item()}


def _side_metrics(side: str, logps: torch.Tensor, rewards: torch.Tensor) -> dict[str, float]:
    """``logps/<side>`` and ``rewards/<side>`` means; nothing for an empty side (a KTO batch may lack one)."""
    if not len(logps):
        return {}
    return {f"logps/{side}": logps.mean().item(), f"rewards/{side}": rewards.mean().item()}


def _dpo_objective(
    log_prob: torch.Tensor, batch: Batch, spec: dict[str, Any]
) -> tuple[torch.Tensor, dict[str, float]]:
    if len(log_prob) % 2:
        raise ValueError(
            f"DPO needs interleaved chosen/rejected rows, got an odd micro-batch of {len(log_prob)}"
        )
    mask = batch["response_mask"].float()
    logps = sequence_log_probs(log_prob, mask)
    ref = sequence_log_probs(batch["ref_log_prob"].to(log_prob.dtype), mask)
    losses, chosen_rewards, rejected_rewards = dpo_loss(
        logps[0::2],
        logps[1::2],
        ref[0::2],
        ref[1::2],
        spec["beta"],
        spec["loss_type"],
        spec["label_smoothing"],
    )
    loss = losses.mean()
    metrics = {
        "loss": loss.item(),
        **_side_metrics("chosen", logps[0::2].detach(), chosen_rewards),
        **_side_metrics("rejected", logps[1::2].detach(), rejected_rewards),
    }
    metrics["rewards/margins"] = (chosen_rewards - rejected_rewards).mean().item()
    metrics["rewards/accuracies"] = (chosen_rewards > rejected_rewards).float().mean().item()
    return loss, metrics


def _kto_objective(
    log_prob: torch.Tensor, batch: Batch, spec: dict[str, Any]
) -> tuple[torch.Tensor, dict[str, float]]:
    mask = batch["response_mask"].float()
    logps = sequence_log_probs(log_prob, mask)
    ref = sequence_log_probs(batch["ref_log_prob"].to(log_prob.dtype), mask)
    desirable = batch["label"].bool()
    losses, rewards = kto_loss(
        logps, ref, desirable, spec["kl"], spec["beta"], spec["desirable_weight"], spec["undesirable_weight"]
    )
    loss = losses.mean()
    detached = logps.detach()
    return loss, {
        "loss": loss.item(),
        "kl": float(spec["kl"]),
        **_side_metrics("chosen", detached[desirable], rewards[desirable]),
        **_side_metrics("rejected", detached[~desirable], rewards[~desirable]),
    }


def _rm_objective(
    rewards: torch.Tensor, batch: Batch, spec: dict[str, Any]
) -> tuple[torch.Tensor, dict[str, float]]:
    """``rewards`` ``(2B,)``: the reward model's scalar for each interleaved chosen/rejected row."""
    if len(rewards) % 2:
        raise ValueError(
            f"a reward model needs interleaved chosen/rejected rows, got an odd micro-batch of {len(rewards)}"
        )
    chosen, rejected = rewards[0::2], rewards[1::2]
    margin = batch["margin"][0::2] if "margin" in batch else None
    loss = bradley_terry_loss(chosen, rejected, margin, spec.get("center_rewards_coefficient")).mean()
    chosen, rejected = chosen.detach(), rejected.detach()
    return loss, {
        "loss": loss.item(),
        "rewards/chosen": chosen.mean().item(),
        "rewards/rejected": rejected.mean().item(),
        "rewards/margins": (chosen - rejected).mean().item(),
        "rewards/accuracies": (chosen > rejected).float().mean().item(),
    }


OFFLINE_OBJECTIVES: dict[str, OfflineObjective] = {
    "sft": OfflineObjective(_sft_objective, "token-mean", needs_ref=False),
    "dpo": OfflineObjective(_dpo_objective, "seq-mean-token-sum", needs_ref=True),
    "kto": OfflineObjective(_kto_objective, "seq-mean-token-sum", needs_ref=True),
    # the first argument is the reward model's scalar per row, not log-probs
    "rm": OfflineObjective(_rm_objective, "seq-mean-token-sum", needs_ref=False),
}


def get_offline_objective(name: str) -> OfflineObjective:
    """The objective ``sft``, ``dpo``, ``kto`` or ``rm``; ValueError naming the choices otherwise."""
    if name not in OFFLINE_OBJECTIVES:
        raise ValueError(f"unknown offline objective {name!r}; known: {sorted(OFFLINE_OBJECTIVES)}")
    return OFFLINE_OBJECTIVES[name]
