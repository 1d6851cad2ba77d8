"""Outcome estimators that compare each response with the others sampled for the same prompt (its group):
GRPO and its vectorized form, RLOO and its vectorized form, OPO, GRPO pass@k, GPG and REINFORCE++ with a
group baseline. verl's names and parameters (``config`` and ``**kwargs`` are accepted as verl's
``compute_advantage`` passes them).

Shapes: ``token_level_rewards`` and ``response_mask`` are ``(bs, T)``; ``index`` holds ``bs`` hashable group
ids (the prompt ``uid``). A response's score is the sum of its token rewards over the mask. Every
estimator returns ``(advantages, returns)``, ``(bs, T)``, the sequence value on every response token and 0
on padding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from hybridflow.algorithms.config_view import ConfigView
from hybridflow.algorithms.estimators import AdvantageEstimator, register_adv_est
from hybridflow.algorithms.utils import masked_whiten


def group_ids(index: Any, bs: int) -> torch.Tensor:
    """Dense group numbers ``(bs,)`` for arbitrary hashable ids, in order of first appearance."""
    ids = list(index)  # not np.asarray: tuple ids would become a 2-D array
    if len(ids) != bs:
        raise ValueError(f"index has {len(ids)} group ids but the batch has {bs} rows")
    dense: dict[Any, int] = {}
    return torch.tensor([dense.setdefault(i, len(dense)) for i in ids], dtype=torch.long)


def sequence_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Outcome score per sequence ``(bs,)``: the sum of its response tokens' rewards."""
    return (token_level_rewards * response_mask.to(token_level_rewards.dtype)).sum(dim=-1)


def group_stats(scores: torch.Tensor, index: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row ``(group mean, group std, group size)``, each ``(bs,)``, for ``scores`` ``(bs,)``.

    The std is unbiased (like ``torch.std``). A group of one has no baseline to compare with: its mean is
    reported as 0 and its std as 1, so its advantage is its raw score.
    """
    ids = group_ids(index, scores.shape[0])
    size = torch.bincount(ids).to(scores.dtype)
    mean = torch.zeros_like(size).index_add_(0, ids, scores) / size
    square_dev = torch.zeros_like(size).index_add_(0, ids, (scores - mean[ids]) ** 2)
    std = (square_dev / (size - 1).clamp_min(1)).sqrt()
    alone = size == 1
    mean = torch.where(alone, 0.0, mean)
    std = torch.where(alone, 1.0, std)
    return mean[ids], std[ids], size[ids]


def broadcast_to_tokens(per_sequence: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``(bs,) -> (bs, T)``: the sequence value on every response token, 0 on padding."""
    return per_sequence.unsqueeze(-1) * response_mask.to(per_sequence.dtype)


def _outcome(advantage: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    advantages = broadcast_to_tokens(advantage, response_mask)
    return advantages, advantages.clone()


@register_adv_est(AdvantageEstimator.GRPO)
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024): each response's score compared with the other responses to its prompt.

    ``A_i = (score_i - mean_group) / (std_group + epsilon)``. ``norm_adv_by_std_in_grpo=False`` gives
    Dr.GRPO (Liu et al. 2025), which drops the std division because it over-weights groups with nearly
    equal scores. ``config`` is accepted as in verl and unused.
    """
    with torch.no_grad():
        scores = sequence_scores(token_level_rewards, response_mask)
        mean, std, _ = group_stats(scores, index)
        centered = scores - mean
        return _outcome(centered / (std + epsilon) if norm_adv_by_std_in_grpo else centered, response_mask)


@register_adv_est(AdvantageEstimator.GRPO_VECTORIZED)
def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's vectorized GRPO: as ``grpo``, but a group's variance is floored at ``epsilon`` (its std at
    ``sqrt(epsilon)``), so near-equal scores give bounded advantages. (Here ``grpo`` is vectorized too;
    this name keeps verl's floor.)"""
    with torch.no_grad():
        scores = sequence_scores(token_level_rewards, response_mask)
        mean, std, size = group_stats(scores, index)
        std = torch.where(size > 1, std.clamp_min(epsilon**0.5), std)
        centered = scores - mean
        return _outcome(centered / (std + epsilon) if norm_adv_by_std_in_grpo else centered, response_mask)


@register_adv_est(AdvantageEstimator.RLOO)
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): baseline = mean score of the OTHER responses to the same prompt.

    ``A_i = score_i - (sum_group - score_i) / (n - 1)``; a response alone in its group keeps its score.
    Leaving the response out keeps the baseline independent of it (an unbiased gradient estimate).
    """
    with torch.no_grad():
        scores = sequence_scores(token_level_rewards, response_mask)
        mean, _, size = group_stats(scores, index)
        others_mean = (size * mean - scores) / (size - 1).clamp_min(1)
        return _outcome(scores - torch.where(size > 1, others_mean, 0.0), response_mask)


@register_adv_est(AdvantageEstimator.RLOO_VECTORIZED)
def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's vectorized RLOO: as ``rloo``, except that a response alone in its group gets advantage 0
    (verl's two RLOO implementations differ there; each name keeps its own)."""
    with torch.no_grad():
        scores = sequence_scores(token_level_rewards, response_mask)
        mean, _, size = group_stats(scores, index)
        others_mean = (size * mean - scores) / (size - 1).clamp_min(1)
        return _outcome(torch.where(size > 1, scores - others_mean, 0.0), response_mask)


@register_adv_est(AdvantageEstimator.OPO)
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025): baseline = the group's scores averaged with each response's length as its
    weight, ``sum_j |o_j| score_j / sum_j |o_j|`` (the optimal baseline for a length-summed loss); a
    response alone in its group keeps its score."""
    with torch.no_grad():
        scores = sequence_scores(token_level_rewards, response_mask)
        lengths = response_mask.to(scores.dtype).sum(dim=-1)
        ids = group_ids(index, scores.shape[0])
        weighted = torch.zeros(int(ids.max()) + 1 if len(ids) else 0, dtype=scores.dtype).index_add_(
            0, ids, lengths * scores
        )
        total = torch.zeros_like(weighted).index_add_(0, ids, lengths)
        size = torch.bincount(ids)[ids]
        baseline = torch.where(size > 1, weighted[ids] / total[ids].clamp_min(1e-8), 0.0)
        return _outcome(scores - baseline, response_mask)


@register_adv_est(AdvantageEstimator.GRPO_PASSK)
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k training (Chen et al. 2025): only each group's best response gets an advantage, its margin
    over the second best ``r_max - r_second`` (divided by ``std_group + epsilon`` when
    ``norm_adv_by_std_in_grpo``, which ``config`` overrides as in verl); every other response gets 0.
    A group needs at least two responses."""
    if config is not None:
        norm_adv_by_std_in_grpo = ConfigView(config).norm_adv_by_std_in_grpo  # a dict or verl's config
    with torch.no_grad():
        scores = sequence_scores(token_level_rewards, response_mask)
        ids = group_ids(index, scores.shape[0])
        _, std, _ = group_stats(scores, index)
        advantage = torch.zeros_like(scores)
        for group in range(int(ids.max()) + 1 if len(ids) else 0):
            members = torch.nonzero(ids == group).flatten()
            if len(members) < 2:
                raise ValueError(
                    f"grpo_passk needs at least 2 responses per group; group {index[members[0]]!r} has 1"
                )
            top = scores[members].topk(2)
            margin = top.values[0] - top.values[1]
            best = members[top.indices[0]]
            advantage[best] = margin / (std[best] + epsilon) if norm_adv_by_std_in_grpo else margin
        return _outcome(advantage, response_mask)


@register_adv_est(AdvantageEstimator.GPG)
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    config: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025): ``A_i = alpha * (score_i - mean_group) / f_norm`` with
    ``alpha = bs / (number of non-zero scores)``, which scales up batches where few responses scored (verl's
    ``alpha`` argument is overwritten the same way, so it is not taken here)."""
    with torch.no_grad():
        scores = sequence_scores(token_level_rewards, response_mask)
        mean, _, _ = group_stats(scores, index)
        alpha = scores.shape[0] / torch.count_nonzero(scores).clamp_min(1)
        return _outcome(alpha * (scores - mean) / f_norm, response_mask)


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE)
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline: score minus its group mean, then whitened over the batch.

    Unlike GRPO the scale comes from the whole batch, not from each group's std.
    """
    with torch.no_grad():
        scores = sequence_scores(token_level_rewards, response_mask)
        mean, _, _ = group_stats(scores, index)
        centered = broadcast_to_tokens(scores - mean, response_mask)
        advantages = masked_whiten(centered, response_mask) * response_mask.to(centered.dtype)
        return advantages, advantages.clone()
