"""Two-stage reward: a cheap scorer on every sample, an expensive one only on the promising ones.

Why: a strong judge (a large reward model, a sandboxed test run, an API call) is often the bottleneck
of a step.  Within a group of samples for the same prompt, the cheap scorer (a small reward model,
a format check, a heuristic) is usually good enough to tell which samples are worth the expensive
look; scoring only the top ``k`` of each group cuts the expensive calls by ``1 - k`` while the samples
that dominate the learning signal still get the accurate score.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hybridflow.protocol import DataProto

__all__ = ["TwoStageReward", "UNSELECTED_MODES", "top_k_per_group"]

Scorer = Callable[[DataProto], torch.Tensor]
UNSELECTED_MODES = ("keep", "scale", "zero")


class TwoStageReward:
    """Score ``data`` with ``cheap_fn``, then re-score a selected subset with ``expensive_fn``.

    Scorers take a DataProto of ``bs`` rows and return float sequence scores of shape ``(bs,)``.

    Selection: per prompt group (rows sharing ``non_tensor_batch[group_key]``; ``group_key=None`` makes
    the whole batch one group), the ``ceil(top_k_ratio * group size)`` rows with the highest cheap score
    (ties go to the earlier row); or, when ``threshold`` is set, instead every row whose cheap score is
    above it.  ``expensive_fn`` is called once, on the selected rows only (``data[selected]``).

    Final score: the expensive score for selected rows; for the others the cheap score (``"keep"``), the
    cheap score times ``unselected_scale`` (``"scale"``) or 0 (``"zero"``).
    """

    def __init__(
        self,
        cheap_fn: Scorer,
        expensive_fn: Scorer,
        top_k_ratio: float = 0.3,
        threshold: float | None = None,
        group_key: str | None = "uid",
        unselected: str = "keep",
        unselected_scale: float = 1.0,
    ) -> None:
        if not 0 < top_k_ratio <= 1:
            raise ValueError(f"top_k_ratio must be in (0, 1], got {top_k_ratio}")
        if unselected not in UNSELECTED_MODES:
            raise ValueError(f"unknown unselected mode {unselected!r}; known: {list(UNSELECTED_MODES)}")
        self.cheap_fn, self.expensive_fn = cheap_fn, expensive_fn
        self.top_k_ratio, self.threshold = top_k_ratio, threshold
        self.group_key, self.unselected, self.unselected_scale = group_key, unselected, unselected_scale

    def __call__(self, data: DataProto) -> tuple[torch.Tensor, dict[str, Any]]:
        """Returns ``(scores, info)``: ``scores`` of shape ``(bs,)`` and ``info`` with

        * ``"metrics"``: ``reward/stage1_calls`` and ``reward/stage2_calls`` (rows each scorer saw) and
          ``reward/stage2_fraction``;
        * ``"stage2_selected"``: bool numpy array ``(bs,)``, which rows got the expensive score (ready for
          ``non_tensor_batch`` or for logging);
        * ``"stage1_scores"``: the cheap scores ``(bs,)``, e.g. to compare both stages."""
        bs = len(data)
        cheap = _scores(self.cheap_fn(data), bs, "cheap_fn")
        selected = self.select(data, cheap)
        chosen = np.flatnonzero(selected)
        if self.unselected == "keep":
            scores = cheap.clone()
        elif self.unselected == "scale":
            scores = cheap * self.unselected_scale
        else:
            scores = torch.zeros_like(cheap)
        if chosen.size:
            expensive = _scores(self.expensive_fn(data[chosen]), chosen.size, "expensive_fn")
            scores[torch.from_numpy(chosen)] = expensive.to(scores.dtype)
        metrics = {
            "reward/stage1_calls": bs,
            "reward/stage2_calls": int(chosen.size),
            "reward/stage2_fraction": chosen.size / bs if bs else 0.0,
        }
        return scores, {"metrics": metrics, "stage2_selected": selected, "stage1_scores": cheap}

    def select(self, data: DataProto, cheap: torch.Tensor) -> np.ndarray:
        """Which rows get the expensive score: bool ``(bs,)`` from cheap scores ``(bs,)``."""
        values = cheap.detach().cpu().double().numpy()
        if self.threshold is not None:
            return values > self.threshold
        return top_k_per_group(values, self._groups(data), self.top_k_ratio)

    def _groups(self, data: DataProto) -> np.ndarray:
        if self.group_key is None:
            return np.zeros(len(data), dtype=np.int64)
        if self.group_key not in data.non_tensor_batch:
            raise KeyError(
                f"TwoStageReward: no group column {self.group_key!r} in non_tensor_batch "
                f"(available: {sorted(data.non_tensor_batch)}); pass group_key=None to rank "
                "the whole batch as one group"
            )
        return np.unique(data.non_tensor_batch[self.group_key], return_inverse=True)[1].reshape(-1)


def top_k_per_group(values: np.ndarray, groups: np.ndarray, ratio: float) -> np.ndarray:
    """Bool mask ``(n,)`` of the ``ceil(ratio * group size)`` largest ``values`` in each group.

    ``groups`` holds integer group ids ``(n,)``.  Ties go to the earlier row (stable sort)."""
    n = len(values)
    order = np.lexsort((-values, groups))  # by group, then by value descending; stable for ties
    sizes = np.bincount(groups)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n) - starts[groups[order]]
    # round first: 0.07 * 100 is 7.000000000000001 in floating point, whose ceil would be 8
    k = np.ceil(np.round(ratio * sizes, 9)).astype(np.int64)
    selected: np.ndarray = rank < k[groups]
    return selected


def _scores(scores: Any, n: int, name: str) -> torch.Tensor:
    if not isinstance(scores, torch.Tensor) or scores.shape != (n,) or not scores.is_floating_point():
        got = (
            f"{scores.dtype} tensor of shape {tuple(scores.shape)}"
            if isinstance(scores, torch.Tensor)
            else type(scores).__name__
        )
        raise ValueError(f"TwoStageReward: {name} must return a float tensor of shape ({n},), got {got}")
    return scores
