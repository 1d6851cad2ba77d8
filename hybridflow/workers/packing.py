"""Doing less arithmetic for the same gradient: one forward per shared prompt, token-budget micro-batches.

**Shared prompts.** GRPO and RLOO sample every prompt ``n`` times, and the rollout lays the ``n`` rows out
consecutively (``DataProto.repeat(n, interleave=True)``). Scored row by row, each row recomputes the whole
prompt, forward and backward: with ~95-token prompts and 16-token answers, 4 samples cost 4 x 111 token
positions where 95 + 4 x 16 hold all the information. ``pack_shared_prompts`` instead builds one row per
group, ``[prompt, response_1, ..., response_n]``, with a 4-D attention mask in which every response attends
to the prompt's real tokens and causally to itself only, and with each response's own position ids (they
restart after the prompt). Each response token then sees exactly the keys and positions it sees in its own
row, so the log-probs are the same up to float rounding, and the gradient reaches the prompt's positions
once, summed over the group, which is what the unshared computation sums over its copies.
Groups are found by content (consecutive rows with identical prompt columns), not by ``uid``: sharing is
exact exactly when the prompts are identical, whatever their origin. A row with no twin (an SFT row, a
replayed row, ``n = 1``) is a group of one: packed alone it only loses its padding.

**Token-budget micro-batches** (verl's ``use_dynamic_bsz``): rather than a fixed row count, micro-batches are
filled up to ``max_token_len`` real tokens, after sorting by length so that rows of similar length (little
padding) travel together; groups are never split unless one alone exceeds the budget. The engine still
weights each micro-batch's loss by its share of the global batch, so the update does not depend on how the
batch was cut.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridflow.protocol import DataProto


def prompt_groups(data: DataProto) -> list[tuple[int, int]]:
    """``[start, end)`` row ranges of consecutive rows whose prompt columns (``input_ids``,
    ``attention_mask``, ``position_ids`` over the first ``T - L`` columns) are identical."""
    n = len(data)
    if n == 0:
        return []
    width = data.batch["input_ids"].shape[1] - data.batch["responses"].shape[1]
    same = torch.ones(n - 1, dtype=torch.bool)
    for key in ("input_ids", "attention_mask", "position_ids"):
        prompt = data.batch[key][:, :width]
        same &= (prompt[1:] == prompt[:-1]).all(dim=1)
    starts = [0] + [i + 1 for i in torch.nonzero(~same).flatten().tolist()]
    return list(zip(starts, starts[1:] + [n]))


@dataclass
class PackedBatch:
    """One packed row per group; the model's outputs over columns ``first_kept - 1 ..`` are gathered back
    into per-response positions with ``rows`` and ``cols``.

    ``input_ids``, ``position_ids`` ``(G, W)``; ``attention_mask`` ``(G, 1, W, W)`` additive (0 or the
    dtype's minimum); ``rows`` ``(bs,)`` the packed row of each original row; ``cols`` ``(bs, L)`` the column
    (counted from ``first_kept - 1``) whose output predicts each response token."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    first_kept: int
    rows: torch.Tensor
    cols: torch.Tensor

    def gather(self, outputs: torch.Tensor) -> torch.Tensor:
        """``outputs`` ``(G, W - first_kept + 1, ...)`` (the model's outputs from column ``first_kept - 1``
        on) -> ``(bs, L, ...)``: the output that predicts each response token (or its value)."""
        return outputs[self.rows[:, None].to(outputs.device), self.cols.to(outputs.device)]


def _real_extent(mask_row: torch.Tensor, from_left: bool) -> int:
    """Columns from the first attended one to the end (prompt), or up to the last attended one (response)."""
    nonzero = torch.nonzero(mask_row).flatten()
    if len(nonzero) == 0:
        return 0
    return len(mask_row) - int(nonzero[0]) if from_left else int(nonzero[-1]) + 1


def pack_shared_prompts(data: DataProto, groups: list[tuple[int, int]], dtype: torch.dtype) -> PackedBatch:
    """Lay every group out as ``[pad, prompt, response_1, ..., response_k, pad]`` with all prompts ending at
    the same column, so one ``logits_to_keep`` keeps exactly the outputs that predict response tokens.

    ``data.batch``: ``input_ids``, ``attention_mask``, ``position_ids`` ``(bs, P + L)`` (left-padded prompt,
    right-padded response) and ``responses`` ``(bs, L)``. Padding columns are dropped (a key the row would
    mask anyway), so a group of one is the plain row without its padding."""
    ids, mask, pos = (data.batch[k] for k in ("input_ids", "attention_mask", "position_ids"))
    length = data.batch["responses"].shape[1]
    width = ids.shape[1] - length
    prompt_lens = [max(1, _real_extent(mask[a, :width], from_left=True)) for a, _ in groups]
    response_lens = [_real_extent(mask[r, width:], from_left=False) for r in range(len(data))]
    lead = max(prompt_lens)
    total = lead + max(sum(response_lens[a:b]) for a, b in groups)
    n_groups = len(groups)
    packed_ids = torch.zeros(n_groups, total, dtype=ids.dtype)
    packed_pos = torch.zeros(n_groups, total, dtype=pos.dtype)
    key_ok = torch.zeros(n_groups, total, dtype=torch.bool)
    segment = torch.full((n_groups, total), -1, dtype=torch.long)  # -1 padding, 0 prompt, i + 1 response i
    rows = torch.zeros(len(data), dtype=torch.long)
    cols = torch.zeros(len(data), length, dtype=torch.long)
    for g, (a, b) in enumerate(groups):
        p = prompt_lens[g]
        packed_ids[g, lead - p:lead] = ids[a, width - p:width]
        packed_pos[g, lead - p:lead] = pos[a, width - p:width]
        key_ok[g, lead - p:lead] = mask[a, width - p:width].bool()
        segment[g, lead - p:lead] = 0
        start = lead
        for i, r in enumerate(range(a, b)):
            n = response_lens[r]
            packed_ids[g, start:start + n] = ids[r, width:width + n]
            packed_pos[g, start:start + n] = pos[r, width:width + n]
            key_ok[g, start:start + n] = mask[r, width:width + n].bool()
            segment[g, start:start + n] = i + 1
            rows[r] = g
            # token t is predicted by the output at column start + t - 1 (token 0 by the prompt's last column)
            cols[r, 1:n] = torch.arange(start, start + max(n - 1, 0)) - (lead - 1)
            start += n
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    same_part = (segment[:, None, :] == 0) | (segment[:, None, :] == segment[:, :, None])
    allowed = causal & same_part & key_ok[:, None, :]
    allowed |= torch.eye(total, dtype=torch.bool)  # no fully masked row (its output is never used)
    additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return PackedBatch(packed_ids, additive[:, None], packed_pos, lead, rows, cols)


def _token_counts(data: DataProto, groups: list[tuple[int, int]], share_prompt: bool) -> list[int]:
    """Real tokens each group costs: one prompt per group when shared, one per row otherwise."""
    mask = data.batch["attention_mask"]
    width = mask.shape[1] - data.batch["responses"].shape[1]
    per_row = mask.sum(dim=1).tolist()
    prompt = mask[:, :width].sum(dim=1).tolist()
    return [sum(per_row[a:b]) - (b - a - 1) * prompt[a] if share_prompt else sum(per_row[a:b]) for a, b in groups]


@dataclass
class MicroBatching:
    """How a batch is cut into micro-batches: ``size`` rows each, or (``max_token_len`` set) as many rows as
    fit in that many real tokens; ``share_prompt`` says the forward shares prompts (a group's cost is then
    one prompt plus its responses)."""

    size: int
    max_token_len: int | None = None
    share_prompt: bool = True

    def indices(self, data: DataProto) -> list[np.ndarray]:
        """Row indices of each micro-batch; together a permutation of ``range(len(data))``."""
        n = len(data)
        if not self.max_token_len:
            step = max(1, self.size)
            return [np.arange(i, min(i + step, n)) for i in range(0, n, step)]
        groups = prompt_groups(data) if self.share_prompt else [(i, i + 1) for i in range(n)]
        units: list[tuple[int, int]] = []
        for a, b in groups:  # a group over the budget goes in as many row-chunks as it needs
            cost = _token_counts(data, [(a, b)], self.share_prompt)[0]
            chunks = max(1, min(b - a, -(-cost // self.max_token_len)))
            bounds = np.linspace(a, b, chunks + 1).round().astype(int)
            units += [(int(s), int(e)) for s, e in zip(bounds[:-1], bounds[1:])]
        costs = _token_counts(data, units, self.share_prompt)
        order = sorted(range(len(units)), key=lambda u: -costs[u])  # similar lengths together: little padding
        batches: list[list[int]] = []
        used = self.max_token_len + 1
        for u in order:
            if used + costs[u] > self.max_token_len:
                batches.append([])
                used = 0
            batches[-1] += range(*units[u])
            used += costs[u]
        return [np.asarray(sorted(rows), dtype=np.int64) for rows in batches]

    def split(self, data: DataProto) -> list[DataProto]:
        return [data[idx] for idx in self.indices(data)]


def as_micro_batching(micro: int | MicroBatching) -> MicroBatching:
    return micro if isinstance(micro, MicroBatching) else MicroBatching(micro)


@torch.no_grad()
def batched(fn: Callable[[DataProto], Any], data: DataProto, micro: int | MicroBatching) -> Any:
    """``fn(micro_batch)`` over micro-batches without gradients (log-prob and value passes), the results
    concatenated back in the rows' original order. ``fn`` returns a tensor ``(rows, ...)`` or a tuple of
    tensors (or ``None``s)."""
    batches = as_micro_batching(micro).indices(data)
    outputs = [fn(data[idx]) for idx in batches]
    inverse = torch.from_numpy(np.argsort(np.concatenate(batches), kind="stable"))

    def merge(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if parts[0] is None else torch.cat(parts)[inverse]

    if isinstance(outputs[0], tuple):
        return tuple(merge([o[i] for o in outputs]) for i in range(len(outputs[0])))
    return merge(outputs)
