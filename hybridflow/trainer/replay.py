"""Replaying past rollouts in the actor update (``replay_buffer.enable=true``).

Each step, ``ActorReplay.mix`` turns the fresh batch into the actor's training batch: it draws
``replay_buffer.sample_size`` rows from a ``ReplayBuffer`` with the ``ScheduledSampler`` in force at this
step, appends them to the fresh rows, and then stores the fresh rows with priority = mean |advantage|
(sampling before storing, so a step never replays its own rows). Replayed rows keep the log-probs of the
policy that generated them (``old_log_probs``), so PPO's ratio corrects for the policy having moved since;
their importance weights scale their advantages. After the update, ``update_priorities`` re-scores the
replayed rows under the updated policy (see ``surrogate_priorities``).

Why the padding: the collate trims every batch to its longest prompt, so batches differ in width, but a
buffer stores rows of one shape. Rows are stored left-padded to ``data.max_prompt_length`` and trimmed
back to the widest real prompt of each training batch, so no pass pays for the padding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hybridflow.dataflow import ReplayBuffer, ScheduledSampler
from hybridflow.dataflow.replay_buffer import IS_WEIGHTS_KEY
from hybridflow.models.routing import ROUTED_EXPERTS
from hybridflow.protocol import DataProto
from hybridflow.utils.errors import UserError
from hybridflow.workers.actor import UPDATE_ACTOR_KEYS
from hybridflow.workers.row_layouts import row_images

__all__ = [
    "ActorReplay",
    "advantage_priorities",
    "set_prompt_width",
    "surrogate_priorities",
    "used_prompt_width",
]

# What the actor update reads, plus ``prompts`` (a replayed row's prompt is re-padded to the batch's width).
ROW_KEYS = ("prompts", *UPDATE_ACTOR_KEYS)
# Columns spanning prompt + response (or, for ``prompts``, the prompt) along dim 1, left-padded: key -> padding
# value. ``None``: the tokenizer's pad id; an MoE rollout's chosen experts are -1 (none) at padding.
LEFT_PADDED = {"input_ids": None, "prompts": None, "attention_mask": 0, "position_ids": 0, ROUTED_EXPERTS: -1}


def _prompt_width(data: DataProto) -> int:
    return data.tensors["input_ids"].shape[-1] - data.tensors["responses"].shape[-1]


def used_prompt_width(data: DataProto) -> int:
    """Prompt columns holding a real token in at least one row (the rest is left padding shared by all)."""
    width = _prompt_width(data)
    real = data.tensors["attention_mask"][:, :width].bool().any(dim=0)
    return width - int(real.int().argmax()) if real.any() else 0


def set_prompt_width(data: DataProto, width: int, pad_token_id: int) -> DataProto:
    """``data`` with its prompts left-padded (or trimmed of shared left padding) to ``width`` columns.

    Changes ``input_ids``, ``attention_mask``, ``position_ids`` ``(bs, P + L)``, ``routed_experts``
    ``(bs, P + L, layers, k)`` and ``prompts`` ``(bs, P)`` to ``P = width``: padding takes ``pad_token_id`` in
    the token columns, -1 in the experts and 0 in the others, as the dataset and the rollout pad. Other
    columns and the rows are shared with ``data``. Cutting a real token raises."""
    current = _prompt_width(data)
    if width < used_prompt_width(data):
        raise ValueError(
            f"set_prompt_width: cannot fit prompts into {width} columns: the longest prompt of "
            f"the batch takes {used_prompt_width(data)} (of {current})"
        )
    out = DataProto(
        batch=data.tensors.clone(recurse=False),
        non_tensor_batch=dict(data.non_tensor_batch),
        meta_info=dict(data.meta_info),
    )
    for key, value in LEFT_PADDED.items():
        if key in out.tensors.keys():
            column = out.tensors[key]
            if width < current:
                out.tensors[key] = column[:, current - width :]
                continue
            fill = pad_token_id if value is None else value
            pad = column.new_full((len(column), width - current, *column.shape[2:]), fill)
            out.tensors[key] = torch.cat([pad, column], dim=1)
    return out


def advantage_priorities(data: DataProto) -> np.ndarray:
    """Mean |advantage| over each row's response tokens: float64 ``(bs,)``, 0 for an empty response."""
    mask = data.tensors["response_mask"].float()
    total = (data.tensors["advantages"].abs() * mask).sum(-1)
    return (total / mask.sum(-1).clamp(min=1)).double().numpy()


def surrogate_priorities(
    advantages: torch.Tensor,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> np.ndarray:
    """Each row's weight in PPO's clipped-surrogate gradient under the current policy: float64 ``(bs,)``.

    Per token, the gradient of ``min(r A, clip(r) A)`` with respect to ``log pi`` is ``r A`` while the
    ratio ``r = exp(log_probs - old_log_probs)`` is inside the clip range on the side ``A`` pushes it to,
    and 0 once it is past it; the priority is the mean of ``|r A|`` over the response tokens. A row the
    policy has already learned from (clipped) stops being drawn; one it moved towards stays. Inputs are
    ``(bs, L)``; ``clip_low``/``clip_high`` are the actor's ``clip_ratio_low``/``clip_ratio_high``."""
    ratio = torch.exp(log_probs - old_log_probs)
    clipped = ((advantages > 0) & (ratio > 1 + clip_high)) | ((advantages < 0) & (ratio < 1 - clip_low))
    mask = response_mask.float()
    weight = (ratio * advantages).abs() * (~clipped) * mask
    return (weight.sum(-1) / mask.sum(-1).clamp(min=1)).double().numpy()


class ActorReplay:
    """The trainer's replay: one ``ReplayBuffer``, its ``ScheduledSampler`` and the rows replayed last.

    ``config`` is the ``replay_buffer`` section; ``rows_per_step`` (``train_batch_size * rollout.n``) is the
    sample size when ``sample_size`` is 0. ``sampler`` may be replaced by any object with
    ``params(step)`` and ``sample(buffer, n, step)``, e.g. a ``ScheduledSampler`` built in Python."""

    def __init__(
        self,
        config: Any,
        *,
        rows_per_step: int,
        max_prompt_length: int,
        pad_token_id: int,
        clip_low: float,
        clip_high: float,
        n_workers: int = 1,
        seed: int | None = None,
    ) -> None:
        self.buffer = ReplayBuffer(config.capacity, seed=seed)
        self.sampler = ScheduledSampler.from_config(config)
        self.sample_size = config.sample_size or rows_per_step
        if self.sample_size % n_workers:
            raise ValueError(
                f"replay_buffer.sample_size ({self.sample_size}) must be a multiple of "
                f"trainer.n_workers ({n_workers}): each worker trains on an equal share"
            )
        self.max_prompt_length, self.pad_token_id = max_prompt_length, pad_token_id
        self.clip_low, self.clip_high = clip_low, clip_high
        self.replayed: tuple[DataProto, np.ndarray] | None = None  # rows and ids of the last mix

    @classmethod
    def from_config(cls, config: Any, pad_token_id: int) -> ActorReplay:
        """From the whole (resolved) ``PPOConfig``: its ``replay_buffer``, batch sizes and clip range."""
        actor, data = config.actor_rollout_ref.actor, config.data
        return cls(
            config.replay_buffer,
            rows_per_step=data.train_batch_size * config.actor_rollout_ref.rollout.n,
            max_prompt_length=data.max_prompt_length,
            pad_token_id=pad_token_id,
            clip_low=actor.clip_ratio if actor.clip_ratio_low is None else actor.clip_ratio_low,
            clip_high=actor.clip_ratio if actor.clip_ratio_high is None else actor.clip_ratio_high,
            n_workers=config.trainer.n_workers,
            seed=config.trainer.seed,
        )

    def mix(self, batch: DataProto, step: int, metrics: dict[str, float]) -> DataProto:
        """The actor's training batch: ``batch``'s rows, then the replayed ones (advantages x weights).

        Needs ``advantages`` and ``old_log_probs`` in ``batch``. Replay starts once the buffer holds rows
        (and, for priority sampling, once one has a priority above 0)."""
        missing = [k for k in ("advantages", "old_log_probs") if k not in batch.tensors.keys()]
        if missing:
            raise KeyError(
                f"replay needs {missing} in the batch: replayed rows must carry the log-probs of "
                "the policy that generated them (compute_log_prob every step)"
            )
        if row_images(batch) is not None:
            raise UserError(
                "replay_buffer.enable: the replay buffer keeps token rows only, not their images; turn it off "
                "for image data"
            )
        keys = [k for k in ROW_KEYS if k in batch.tensors.keys()]
        fresh = set_prompt_width(
            batch.select(batch_keys=keys, non_tensor_batch_keys=[], meta_info_keys=[]),
            self.max_prompt_length,
            self.pad_token_id,
        )
        params = self.sampler.params(step)
        self.replayed, rows = None, fresh
        if len(self.buffer) and (params["strategy"] == "uniform" or self.buffer.priorities.max() > 0):
            replayed, ids, weights = self.sampler.sample(self.buffer, self.sample_size, step)
            replayed.tensors.pop(IS_WEIGHTS_KEY)
            self.replayed = (replayed, ids)
            weighted = DataProto(batch=replayed.tensors.clone(recurse=False))
            weighted.tensors["advantages"] = (
                replayed.tensors["advantages"] * torch.from_numpy(weights).float()[:, None]
            )
            rows = DataProto.concat([fresh, weighted])
            metrics["replay/is_weight_mean"] = float(weights.mean())
        self.buffer.push(fresh, priorities=advantage_priorities(fresh))
        metrics.update(
            {
                "replay/rows": len(rows) - len(fresh),
                "replay/buffer_size": len(self.buffer),
                "replay/prioritized": float(params["strategy"] == "priority"),
                # the exponent in force: uniform sampling is alpha 0, whatever the config's alpha
                "replay/alpha": params["alpha"] if params["strategy"] == "priority" else 0.0,
            }
        )
        return set_prompt_width(rows, used_prompt_width(rows), self.pad_token_id)

    def update_priorities(self, actor_rollout: Any, metrics: dict[str, float]) -> None:
        """Re-score the rows replayed last under the updated policy (``actor_rollout.compute_log_prob``)."""
        if self.replayed is None:
            return
        rows, ids = self.replayed
        rows = set_prompt_width(rows, used_prompt_width(rows), self.pad_token_id)
        log_probs = actor_rollout.compute_log_prob(rows).batch["old_log_probs"]
        priorities = surrogate_priorities(
            rows.tensors["advantages"],
            log_probs,
            rows.tensors["old_log_probs"],
            rows.tensors["response_mask"],
            self.clip_low,
            self.clip_high,
        )
        self.buffer.update_priorities(ids, priorities)
        metrics["replay/priority_mean"] = float(self.buffer.priorities.mean())
        self.replayed = None

    def state_dict(self) -> dict[str, Any]:
        """The buffer's rows, priorities and random state (for the trainer's checkpoint)."""
        return self.buffer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state)
