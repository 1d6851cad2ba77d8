"""DAPO's sample-level pieces (Yu et al. 2025): which GRPO groups teach nothing, the overlong penalty, and
which samples were cut at the length budget.

- **Dynamic sampling.** A group whose samples all earned the same reward has zero advantage under any
  group baseline: it costs a rollout and an update and moves nothing. ``informative_groups`` says which
  rows belong to groups whose metric varies; the trainer keeps those and generates more prompts until the
  batch is full (``hybridflow.trainer.dynamic_sampling``).
- **Overlong reward shaping.** ``overlong_penalty`` is 0 up to ``max_length - buffer_len`` tokens, then falls
  linearly to ``-penalty_factor`` at ``max_length``: a soft signal that the answer is running out of budget,
  instead of the hard cliff of a truncated (and so usually wrong) answer.
- **Overlong filtering.** ``truncated`` marks the samples that hit the budget without ending; masking them
  out of the loss keeps the model from being punished for a reasoning it was not allowed to finish.

Pure functions over ``(bs,)`` or ``(bs, T)`` tensors and the batch's ``uid`` column (one id per prompt,
shared by its samples).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

#: a ``uid`` column: a list or the DataProto's object array
Uids = Sequence[Any] | np.ndarray


def group_ids(uids: Uids) -> tuple[np.ndarray, int]:
    """``(row -> group index in order of first appearance, number of groups)`` for a ``uid`` column."""
    index: dict[Any, int] = {}
    groups = np.array([index.setdefault(u, len(index)) for u in uids], dtype=np.int64)
    return groups, len(index)


def group_spread(uids: Uids, values: torch.Tensor) -> torch.Tensor:
    """Each group's ``max - min`` of ``values`` ``(bs,)``, in order of first appearance ``(groups,)``."""
    groups, count = group_ids(uids)
    index = torch.as_tensor(groups)
    values = values.double()
    high = torch.full((count,), -torch.inf, dtype=values.dtype).scatter_reduce(0, index, values, "amax")
    low = torch.full((count,), torch.inf, dtype=values.dtype).scatter_reduce(0, index, values, "amin")
    return high - low


def group_std(uids: Uids, values: torch.Tensor) -> torch.Tensor:
    """Each group's population standard deviation of ``values`` ``(bs,)`` ``(groups,)`` (0 for one row)."""
    groups, count = group_ids(uids)
    index = torch.as_tensor(groups)
    values = values.double()
    size = torch.zeros(count, dtype=values.dtype).index_add(0, index, torch.ones_like(values))
    mean = torch.zeros(count, dtype=values.dtype).index_add(0, index, values) / size
    var = torch.zeros(count, dtype=values.dtype).index_add(0, index, (values - mean[index]).square()) / size
    return var.sqrt()


def informative_groups(uids: Uids, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which rows to keep ``(bs,)`` bool and which groups ``(groups,)`` bool: a group is kept when its
    ``values`` differ (exact comparison: rewards are usually a few distinct numbers) or when it holds a single
    row, as verl does (nothing to compare it with; ``rollout.n=1`` filters nothing)."""
    groups, count = group_ids(uids)
    sizes = np.bincount(groups, minlength=count)
    kept = (group_spread(uids, values) > 0) | torch.as_tensor(sizes == 1)
    return kept[torch.as_tensor(groups)], kept


def first_groups(uids: Uids, count: int) -> torch.Tensor:
    """Rows ``(bs,)`` bool of the first ``count`` groups, in order of first appearance: the trim of a
    refilled batch to ``data.train_batch_size`` prompts."""
    groups, _ = group_ids(uids)
    return torch.as_tensor(groups < count)


def overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment ``(bs,) -> (bs,)``: ``min(0, -(L - (max_length - buffer_len)) /
    buffer_len * penalty_factor)`` for a response of ``L`` tokens, i.e. 0 up to ``max_length - buffer_len``
    tokens, ``-penalty_factor`` at ``max_length``, linear between."""
    if not 0 < buffer_len <= max_length:
        raise ValueError(f"overlong buffer length must be in (0, {max_length}], got {buffer_len}")
    exceed = lengths.to(torch.float32) - (max_length - buffer_len)
    return (-exceed / buffer_len * penalty_factor).clamp(max=0.0)


def truncated(
    responses: torch.Tensor, response_mask: torch.Tensor, max_length: int, eos_token_ids: Sequence[int]
) -> torch.Tensor:
    """Samples cut at the length budget ``(bs,)`` bool: ``max_length`` response tokens whose last one is no
    end-of-sequence token (one that ends exactly at the budget with EOS finished)."""
    mask = response_mask.bool()
    lengths = mask.sum(dim=-1)
    last = (mask * torch.arange(1, mask.shape[-1] + 1, device=mask.device)).argmax(dim=-1)
    last_token = responses.gather(-1, last[:, None]).squeeze(-1)
    ended = torch.isin(last_token, torch.as_tensor(list(eos_token_ids), device=responses.device))
    return (lengths >= max_length) & ~ended
