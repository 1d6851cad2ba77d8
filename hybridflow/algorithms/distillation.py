"""On-policy distillation: the student samples, a teacher scores the same tokens, and the per-token reverse KL
``KL(student || teacher)`` is the training signal (Agarwal et al. 2024's GKD with lambda = 1; Thinking
Machines' "on-policy distillation", 2025).

At a sampled token ``y_t ~ pi_s``, ``log pi_s(y_t) - log pi_t(y_t)`` is an unbiased one-sample estimate of the
reverse KL at that position, and it is dense: every token says how much the teacher disagrees with it,
where a task reward speaks once per sample. Two ways to train on it (``actor_rollout_ref.teacher.signal``):

- ``reward``: ``-kl_coef * (log pi_s - log pi_t)`` is a per-token reward added to the task reward (scaled by
  ``task_reward_coef``), and the chosen advantage estimator turns it into advantages like any reward
  (``distillation_rewards``).
- ``loss``: ``kl_coef * KL`` is a loss term beside the policy loss, with a KL estimator whose gradient is
  the on-policy one (``k2``: ``0.5 * (log pi_s - log pi_t)^2`` has the gradient of the reverse KL's
  per-token policy gradient; ``hybridflow.algorithms.kl_penalty``).

Token tensors are ``(bs, T)`` log-probs of the sampled response tokens.
"""

from __future__ import annotations

import torch

from hybridflow.algorithms.utils import masked_mean


def reverse_kl(student_log_prob: torch.Tensor, teacher_log_prob: torch.Tensor) -> torch.Tensor:
    """The sampled estimate of ``KL(student || teacher)`` per token ``(bs, T)``: ``log pi_s - log pi_t``."""
    return (student_log_prob - teacher_log_prob).detach()


def distillation_rewards(
    task_rewards: torch.Tensor,
    student_log_prob: torch.Tensor,
    teacher_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    task_reward_coef: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token rewards ``(bs, T)``: ``task_reward_coef * task_rewards - kl_coef * (log pi_s - log pi_t)`` on the
    response tokens (0 elsewhere), and metrics: ``distill/reverse_kl`` (mean per response token),
    ``distill/reverse_kl_seq`` (mean per sample of its sum: what an outcome estimator such as GRPO sees)."""
    mask = response_mask.to(task_rewards.dtype)
    kl = reverse_kl(student_log_prob, teacher_log_prob).to(task_rewards.dtype) * mask
    rewards = task_reward_coef * task_rewards - kl_coef * kl
    metrics = {
        "distill/reverse_kl": float(masked_mean(kl, mask)),
        "distill/reverse_kl_seq": float(kl.sum(dim=-1).mean()),
    }
    return rewards, metrics
