"""DAPO's dynamic sampling in the run (``algorithm.filter_groups``): a step's batch is refilled with the groups
that teach something.

A GRPO group whose samples all got the same reward has zero advantage: it costs a rollout and an update and
moves nothing. ``GroupFilter.fill`` generates a batch of prompts, scores it, keeps the groups whose
``filter_groups.metric`` varies (``hybridflow.algorithms.informative_groups``), and draws the next batch of
prompts from the same loader until ``data.train_batch_size`` groups are kept or
``filter_groups.max_num_gen_batches`` batches were generated; then the kept groups are the step's batch, in
the order they were generated, trimmed to ``train_batch_size`` groups (the surplus of the last generation batch
is dropped, as in verl). When the cap comes first the step trains on the groups it has, and says so (a
warning and ``dynamic_sampling/full_batch`` 0); a step that kept no group at all trains on its last generation
batch, whose advantages are zero.

The same object serves every source of samples: the lock-step trainer calls it in its step, an asynchronous
run's producer before it queues the batch (it oversamples ahead of the trainer), and the agent loop or a served
agent generate its batches like any rollout. Each generation batch is drawn from the prompt stream under the
step's number, so a checkpoint records the loader's position after the *last* batch the step drew: a resumed
run draws what an uninterrupted one would, no prompt lost or repeated.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hybridflow.algorithms import first_groups, informative_groups
from hybridflow.protocol import DataProto
from hybridflow.trainer.replay import set_prompt_width, used_prompt_width
from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)

#: filter metrics read from the scores themselves (the rest come from the reward function's dict)
SCORE_METRICS = ("seq_reward", "seq_final_reward")

Score = Callable[[DataProto, dict[str, float]], DataProto]


def filter_values(batch: DataProto, metric: str) -> torch.Tensor:
    """What must vary within a group, one value per row ``(bs,)``: the summed ``token_level_scores`` for
    ``seq_reward``, else the reward function's ``metric`` (``reward_extra/<metric>``)."""
    if metric in SCORE_METRICS:
        return batch.tensors["token_level_scores"].sum(dim=-1)
    column = batch.non_tensor_batch.get(f"reward_extra/{metric}")
    returned = sorted(
        k.removeprefix("reward_extra/") for k in batch.non_tensor_batch if k.startswith("reward_extra/")
    )
    if column is None or any(v is None for v in column):
        raise UserError(
            f"algorithm.filter_groups.metric={metric!r}: the reward function did not return {metric!r} for "
            f"every sample (its dicts hold {returned or 'nothing but the score'}); use seq_reward or one of those"
        )
    return torch.tensor([float(v) for v in column], dtype=torch.float64)


class GroupFilter:
    """Refills a step's batch with informative groups; ``score(batch, metrics)`` adds ``token_level_scores``
    (and the reward function's ``reward_extra/*``) to a generated batch, as the trainer's reward stage does."""

    def __init__(self, config: Any, groups_per_step: int, pad_token_id: int, score: Score) -> None:
        self.metric, self.cap = config.metric, config.max_num_gen_batches
        self.groups_per_step, self.pad_token_id, self.score = groups_per_step, pad_token_id, score

    def fill(
        self,
        prompts: DataProto,
        generate: Callable[[DataProto], DataProto],
        more: Callable[[], DataProto],
    ) -> DataProto:
        """The step's scored batch: ``generate(prompts)`` first, then ``generate(more())`` until it holds
        ``groups_per_step`` informative groups or the cap is reached. ``meta_info["metrics"]`` gets the
        filter's metrics (``dynamic_sampling/*``) beside the rollouts' and the reward function's."""
        kept: list[DataProto] = []
        metrics: dict[str, float] = {}
        counts = {"batches": 0, "samples": 0, "groups": 0, "kept": 0}
        while True:
            batch = self.score(generate(prompts), metrics)
            rows, groups = informative_groups(
                batch.non_tensor_batch["uid"], filter_values(batch, self.metric)
            )
            counts["batches"] += 1
            counts["samples"] += len(batch)
            counts["groups"] += len(groups)
            counts["kept"] += int(groups.sum())
            if rows.any():
                kept.append(batch[rows.numpy()])
            if counts["kept"] >= self.groups_per_step or 0 < self.cap <= counts["batches"]:
                break
            prompts = more()
        out = self._trimmed(kept) if kept else batch
        if counts["kept"] < self.groups_per_step:
            logger.warning(
                "dynamic sampling: %d of %d groups varied in %d generation batches "
                "(algorithm.filter_groups.max_num_gen_batches); the step trains on %s",
                counts["kept"],
                self.groups_per_step,
                counts["batches"],
                "them" if kept else "the last batch (zero advantages)",
            )
        metrics.update(_metrics(counts, len(out), self.groups_per_step))
        out.meta_info["metrics"] = {**out.meta_info.get("metrics", {}), **metrics}
        return out

    def _trimmed(self, parts: list[DataProto]) -> DataProto:
        """The kept rows of every generation batch, prompts padded to one width, cut to ``groups_per_step``
        groups."""
        width = max(used_prompt_width(p) for p in parts)
        parts = [set_prompt_width(p, width, self.pad_token_id) for p in parts]
        batch = DataProto.concat(_same_columns(parts))
        return batch[first_groups(batch.non_tensor_batch["uid"], self.groups_per_step).numpy()]


def _same_columns(parts: list[DataProto]) -> list[DataProto]:
    """The reward function may return other dict keys for other batches: a key a batch lacks is None there."""
    extra = dict.fromkeys(k for p in parts for k in p.non_tensor_batch if k.startswith("reward_extra/"))
    for part in parts:
        for key in extra:
            if key not in part.non_tensor_batch:
                part.non_tensor_batch[key] = np.full(len(part), None, dtype=object)
    return parts


def _metrics(counts: dict[str, int], trained: int, wanted: int) -> dict[str, float]:
    """``dynamic_sampling/*``: generation batches, samples generated, the share of groups kept and filtered,
    samples generated per sample trained, and whether ``wanted`` groups were kept (the batch is full)."""
    groups = max(counts["groups"], 1)
    return {
        "dynamic_sampling/gen_batches": float(counts["batches"]),
        "dynamic_sampling/samples_generated": float(counts["samples"]),
        "dynamic_sampling/kept_group_frac": counts["kept"] / groups,
        "dynamic_sampling/filtered_group_frac": 1 - counts["kept"] / groups,
        "dynamic_sampling/samples_per_trained_sample": counts["samples"] / max(trained, 1),
        "dynamic_sampling/full_batch": float(counts["kept"] >= wanted),
    }
