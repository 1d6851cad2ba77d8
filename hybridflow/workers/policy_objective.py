"""What the actor minimises on a micro-batch of rollouts, given the policy's log-probs of the sampled tokens: the
registered policy loss on (corrected) advantages, minus the entropy bonus, plus the KL to the reference and
the distillation term where the config asks for them; and the metrics each part reports.

Pure functions of tensors and the typed config (no model, no worker state), so each term reads and tests on
its own; ``ActorRolloutRefWorker._policy_loss`` runs the forward and calls ``policy_objective``.
"""

from __future__ import annotations

import torch

from hybridflow.algorithms import (
    ConfigView,
    agg_loss,
    get_policy_loss_fn,
    kl_penalty,
    masked_mean,
    off_policy_mask,
    reverse_kl,
    truncated_importance_weights,
)
from hybridflow.config import ActorConfig, ActorRolloutRefConfig, TeacherConfig
from hybridflow.protocol import DataProto

#: The policy-loss metrics that are 0 by construction when the data is used once (the ratio is exactly 1):
#: left out of such a step's metrics when they are 0, so the console does not show ``ppo_kl 0`` every step
#: (a loss whose clip fraction means something else, Clip-Cov's share of cut tokens, keeps it).
ZERO_ON_POLICY = ("actor/ppo_kl", "actor/pg_clipfrac", "actor/pg_clipfrac_lower")


def policy_objective(
    config: ActorRolloutRefConfig, micro: DataProto, log_prob: torch.Tensor, entropy: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy-gradient loss - entropy bonus (+ KL to the reference, + distillation) of ``micro``'s responses,
    from the policy's ``log_prob`` and ``entropy`` ``(bs, L)`` of them; the loss and its metrics."""
    actor = config.actor
    mask = micro.tensors["response_mask"].float()
    # On-policy shortcut: with one pass over the data the old policy *is* the current one, so the
    # driver may skip the extra forward pass and let the ratio start at exactly 1.
    on_policy = "old_log_probs" not in micro.tensors.keys()
    old = log_prob.detach() if on_policy else micro.tensors["old_log_probs"]
    advantages, tis_metrics = off_policy_corrected(actor, micro, old, log_prob.detach(), mask)
    # verl's calling convention, so a loss registered for verl runs unchanged; the engine weighs the
    # micro-batches itself, hence no whole-batch counts in global_batch_info
    pg_loss, pg_metrics = get_policy_loss_fn(actor.policy_loss.loss_mode)(
        old_log_prob=old,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=mask,
        loss_agg_mode=actor.loss_agg_mode,
        config=ConfigView(actor, global_batch_info={}),
        rollout_is_weights=None,
    )
    entropy_loss = agg_loss(entropy, mask, actor.loss_agg_mode)
    loss = pg_loss - actor.entropy_coeff * entropy_loss
    if on_policy:  # with the ratio exactly 1 the KL to the old policy and PPO's clip fractions are 0
        pg_metrics = {k: v for k, v in pg_metrics.items() if not (k in ZERO_ON_POLICY and v == 0.0)}
    metrics = {
        "actor/pg_loss": pg_loss.item(),
        **pg_metrics,
        "actor/entropy": entropy_loss.item(),
        **tis_metrics,
    }
    if "ref_log_prob" in micro.tensors.keys():  # KL(policy || reference), k1 estimate over the sampled tokens
        metrics["actor/kl_ref"] = float(masked_mean(log_prob.detach() - micro.tensors["ref_log_prob"], mask))
    if actor.use_kl_loss:
        kl = kl_penalty(log_prob, micro.tensors["ref_log_prob"], actor.kl_loss_type)
        kl_loss = agg_loss(kl, mask, actor.loss_agg_mode)
        loss = loss + actor.kl_loss_coef * kl_loss
        metrics.update({"actor/kl_loss": kl_loss.item(), "actor/kl_coef": actor.kl_loss_coef})
    if config.teacher.signal == "loss" and "teacher_log_prob" in micro.tensors.keys():
        distill_loss, distill_metrics = distillation_loss(config.teacher, actor, micro, log_prob, mask)
        loss = loss + config.teacher.kl_coef * distill_loss
        metrics.update(distill_metrics)
    if "rollout_log_probs" in micro.tensors.keys() and on_policy:
        metrics.update(logprob_diff_metrics(micro.tensors["rollout_log_probs"], log_prob.detach(), mask))
    return loss, metrics


def distillation_loss(
    teacher: TeacherConfig, actor: ActorConfig, micro: DataProto, log_prob: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """On-policy distillation as a loss term: the KL estimate ``teacher.kl_loss_type`` between the policy
    and the teacher's log-probs of the sampled tokens, aggregated as the policy loss is."""
    teacher_log_prob = micro.tensors["teacher_log_prob"]
    kl = kl_penalty(log_prob, teacher_log_prob, teacher.kl_loss_type)
    loss = agg_loss(kl, mask, actor.loss_agg_mode)
    reverse = float(masked_mean(reverse_kl(log_prob, teacher_log_prob), mask))
    return loss, {"actor/distill_loss": loss.item(), "distill/reverse_kl": reverse}


def off_policy_corrected(
    actor: ActorConfig, micro: DataProto, old: torch.Tensor, current: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """Advantages ``(bs, L)`` corrected for samples the rollout engine drew (when its log-probs came with
    the batch): weighted by truncated importance sampling ``old / rollout`` (``actor.tis_imp_ratio_cap``),
    and zeroed where the trainer's ``current`` log-probs left ``actor.off_policy_mask_bounds`` around the
    rollout's (``actor.off_policy_mask``; in an asynchronous run ``old`` is the rollout's own, so only the
    current policy tells how far the weights moved since the sample was drawn)."""
    advantages = micro.tensors["advantages"]
    if "rollout_log_probs" not in micro.tensors.keys():
        return advantages, {}
    rollout, metrics = micro.tensors["rollout_log_probs"], {}
    if actor.tis_imp_ratio_cap > 0:
        weights, tis_clipfrac = truncated_importance_weights(
            old, rollout, mask, actor.tis_imp_ratio_cap, actor.tis_level
        )
        advantages = advantages * weights
        metrics["actor/tis_clipfrac"] = float(tis_clipfrac)
        metrics["actor/tis_weight_mean"] = float(masked_mean(weights, mask))
    if rollout.abs().sum() > 0:  # sampled (a greedy rollout has no log-probs): ratio stats, and the mask
        low, high = actor.off_policy_mask_bounds
        keep, mask_metrics = off_policy_mask(current, rollout, mask, actor.off_policy_mask, low, high)
        advantages = advantages * keep
        metrics.update(mask_metrics)
    return advantages, metrics


def logprob_diff_metrics(
    rollout_log_probs: torch.Tensor, log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """How far the rollout engine's log-probs are from the trainer's for the same weights and tokens:
    a numerical mismatch (KV cache, kernels, another engine) that quietly biases PPO's ratio."""
    diff = (rollout_log_probs - log_probs).abs()
    return {
        "rollout/logprob_diff": float(masked_mean(diff, response_mask)),
        "rollout/logprob_diff_max": float((diff * response_mask).max()),
    }
